"""Kernel demo: swap rltrain's kernels into a small Qwen3 and show that logits and gradients do not change.

Quick start command 1 runs this until the GRPO trainer (`python -m rltrain.main_grpo`) lands:

    bash scripts/quickstart.sh                       # sets up .venv, then runs this file
    .venv/bin/python examples/kernel_demo.py --model-type llama --seq 64

The model is built from a config (no hub access). It is run unpatched, then with each kernel set swapped in through
the registry: the Triton kernels (natively on a GPU; through the Triton interpreter on a CPU, which is slow but
runs the very same kernel code), and the detected device's default set. Exits non-zero when a result drifts past
the threshold.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time


def build_model(model_type: str, dtype, device):
    import transformers as tf

    dims = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[model_type]
    config = config_cls(**dims)
    config._attn_implementation = "eager"
    return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def run(model, input_ids, grad_logits):
    """Logits and gradients of sum(logits * grad_logits); the time is that of a second, warm pass."""
    import torch

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(input_ids=input_ids).logits
        (logits.float() * grad_logits).sum().backward()
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double(), grads, elapsed


def rel_error(a, b) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-type", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():  # must precede the first `import triton`
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rltrain_kernels.registry import apply_default_kernels, get_applied_kernels, get_default_kernels
    from rltrain_kernels.utils import detect_device

    torch.manual_seed(args.seed)
    detected = detect_device()
    device = "cuda" if detected == "cuda" else "cpu"
    threshold = 1e-5  # fp32 end to end
    model = build_model(args.model_type, torch.float32, device)
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    grad_logits = torch.randn(args.batch, args.seq, model.config.vocab_size, device=device)
    ref_logits, ref_grads, ref_time = run(model, input_ids, grad_logits)

    impls = [("cuda", "Triton" + ("" if detected == "cuda" else " (interpreter)"))]
    if detected != "cuda":
        impls.append((detected, f"{detected} defaults"))
    rows = []
    for impl_device, label in impls:
        patched = copy.deepcopy(model)
        applied = get_applied_kernels(apply_default_kernels(patched, "auto", device=impl_device))
        logits, grads, elapsed = run(patched, input_ids, grad_logits)
        worst_name, worst = max(((n, rel_error(grads[n], g)) for n, g in ref_grads.items()), key=lambda t: t[1])
        logit_err = rel_error(logits, ref_logits)
        ok = logit_err <= threshold and worst <= threshold
        rows.append((label, ", ".join(f"{k}×{v}" for k, v in applied.items()), f"{logit_err:.1e}",
                     f"{worst:.1e} ({worst_name.removeprefix('model.')})", f"{elapsed * 1e3:.0f}",
                     "ok" if ok else "MISMATCH"))

    print(f"\nrltrain kernels on a {args.model_type} model ({sum(p.numel() for p in model.parameters()):,} params, "
          f"fp32, batch {args.batch} x seq {args.seq}); detected device: {detected}; "
          f"default kernels here: {', '.join(get_default_kernels()) or 'none'}")
    print(f"unpatched forward+backward: {ref_time * 1e3:.0f} ms (warm); pass threshold: relative error <= {threshold:.0e}\n")
    header = ("implementation", "modules swapped", "logits rel err", "worst grad rel err", "fwd+bwd ms", "result")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
