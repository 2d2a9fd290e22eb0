"""A delta-rule policy against a Qwen3 of the same shape, on one GPU, side by side in one process: rltrain's actor
step (old log-probs + one update, packed micro-batches, the registry's kernels) and the HF rollout engine's
decoding (transformers' `generate`, KV cache for Qwen3; for the hybrid and Qwen3-Next, the recurrent cache and the
fused-recurrent kernels), both in bf16, built from config:

    qwen3    a 1B-class Qwen3: 16 layers, hidden 2048, MLP 6144, 16 query / 8 key-value heads of 128, vocab 151,936
    hybrid   the same with 3 of every 4 layers Gated DeltaNet (16 heads of 128 keys and values), Qwen3-Next's mix
    gdp      every layer Gated DeltaProduct (2 Householder steps per token)
    iplr     every layer IPLR
    qwen3_next   transformers' Qwen3-Next at Qwen3-Next-80B-A3B's widths (hidden 2048; 16 query / 2 key-value heads of
             256, partial rotary 0.25; Gated DeltaNet 16 key / 32 value heads of 128, conv 4; MoE top-10 of experts of
             512 plus a shared expert of 512; untied head) at 4 layers (3 Gated DeltaNet, then attention) and 128 of
             its 512 experts: 2.38B parameters, 44 GiB at mixed precision's 20 bytes a parameter (bf16 weights, fp32
             masters, gradients and AdamW state; all 512: 7.2B, 134 GiB, no room left on a 139 GiB H200 for the
             activations). Its actor step runs with actor.mixed_precision (the framework's default; the others train
             bf16 in place) twice: packed (the default) and padded (use_remove_padding=false, micro-batches of 4
             rows); the note gives packed's speed-up and its old log-probs against padded's ("vs qwen3": "-", another
             shape). Not in the default --archs

`--engines hf,vllm` decodes with vLLM too (the rollout engine's vllm path, CUDA graphs, gpu_memory_utilization 0.5)
where vLLM serves the model: qwen3 and qwen3_next as built, hybrid through its Qwen3-Next form (rltrain.export's
conversion, the form `python -m rltrain.export` writes: two copies of each value head, so vLLM decodes twice the
Gated DeltaNet state hf does); gdp and iplr have none. Correctness first there too: the
log-probs vLLM reports for its sampled tokens (8 prompts) against rltrain's actor on the model as trained (for hybrid:
the family with the registry's kernels), as a relative error. `--decode-only` skips the actor steps.

Actor step: `--responses` responses after `--prompt-len`-token prompts, log-normal lengths (bench_actor_step.py's
batch); tokens/s counts prompt + response tokens over both passes, the faster of two steps after two warm-up
steps. Decoding: `--decode-batch` prompts of `--decode-prompt` random tokens, `--decode-len` new tokens sampled at
temperature 1 (an <eos> the random model hardly ever draws, so rows decode the full length); tokens/s = the new
tokens generated (the response masks) over the wall time. Correctness first: each delta-rule model's old log-probs
with the kernels against its plain-PyTorch path (fp32 recurrence) on a small batch, as a relative error. Needs a
CUDA GPU, rltrain and rltrain-kernels installed (README.md beside this file).

    python benchmarks/bench_hybrid_policy.py                  # all four archs
    python benchmarks/bench_hybrid_policy.py --archs qwen3,hybrid
    python benchmarks/bench_hybrid_policy.py --archs qwen3_next          # packed vs padded, and decoding
    python benchmarks/bench_hybrid_policy.py --archs qwen3,hybrid,qwen3_next --engines hf,vllm --decode-only
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from bench_actor_step import RltrainPath, make_batch, release_memory, timed_step
from checkpoints import QWEN3_COMMON, QWEN3_SIZES, VOCAB, word_tokenizer

from rltrain_kernels.models.hybrid_delta import HybridDeltaConfig
from rltrain_kernels.models.hybrid_delta.qwen3_next import qwen3_next_refusal
from rltrain_kernels.registry import get_applied_kernels

LAYERS = 16
SHAPE = {**QWEN3_SIZES["1.7b"], **QWEN3_COMMON, "num_hidden_layers": LAYERS}   # Qwen3-1.7B's shape at 16 layers
MIXERS = {"hybrid": ["gated_delta_rule"] * 3 + ["full_attention"], "gdp": ["gated_delta_product"],
          "iplr": ["iplr"]}
# Qwen3-Next-80B-A3B's config.json at 4 layers and 128 experts (the docstring's sizing); every layer sparse
QWEN3_NEXT = dict(hidden_size=2048, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                  num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
                  rope_theta=1e7, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=128, num_experts_per_tok=10,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, vocab_size=VOCAB)
PADDED_ROWS = 4   # qwen3_next's padded micro-batches: 4 rows of up to 4,352 tokens, about the packed 16k budget
AUTO = {"name": "auto", "include_kernels": "auto"}


def build_model_dir(arch: str, root: str) -> str:
    import transformers as tf

    import rltrain_kernels.models as families

    eos = dict(eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 1)
    if arch == "qwen3":
        config = tf.Qwen3Config(**SHAPE, **eos)
    elif arch == "qwen3_next":
        config = tf.Qwen3NextConfig(**QWEN3_NEXT, **eos)
    else:
        pattern = MIXERS[arch]
        config = families.HybridDeltaConfig(layer_types=[pattern[i % len(pattern)] for i in range(LAYERS)],
                                            linear_num_heads=16, linear_head_dim=128, num_householder=2,
                                            **SHAPE, **eos)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # the LM head's <eos> row (tied: the embedding's) zeroed: its logit is 0 everywhere: a draw's chance about 4e-6 at
    # 151,936 words (scaling the row flips its logit's sign with the hidden state's: an untied head then draws it)
    with torch.no_grad():
        model.get_output_embeddings().weight[VOCAB - 1].zero_()
    path = f"{root}/{arch}"
    model.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)   # the rollout engine loads it (generation_config.json's ids win)
    return path


def kernel_vs_torch_error(model_dir: str, device: str = "cuda") -> float:
    """Old log-probs on 8 short responses: the registry's kernels against the plain-PyTorch layers."""
    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor import ActorWorker
    from rltrain.workers.actor_config import ActorConfig

    batch = make_batch(8, 64, 200, 400, seed=3)
    logps = []
    for kernels in (AUTO, {"name": "auto", "include_kernels": "none"}):
        actor = ActorWorker(ActorConfig(lr=1e-6, use_remove_padding=True), LossConfig(), model_dir, "bfloat16",
                            kernels, temperature=1.0, device=device)
        logps.append(actor.compute_logprobs(batch).double())
        actor = None
        release_memory()
    mask = batch["response_mask"].bool()
    return ((logps[0] - logps[1])[mask].norm() / logps[1][mask].norm()).item()


def decode_prompts(args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(100, VOCAB - 100, (args.decode_batch, args.decode_prompt), generator=g)
    return ids, torch.ones_like(ids)


def decode(model_dir: str, args, device: str = "cuda") -> tuple[float, int]:
    """(tokens/s, decoding steps) of the HF rollout engine."""
    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    worker = RolloutWorker(RolloutConfig(n=1, max_new_tokens=args.decode_len, micro_batch_size=args.decode_batch),
                           model_dir, "bfloat16", AUTO, device=device)
    ids, mask = decode_prompts(args)
    worker.generate(ids[:, :16], mask[:, :16], 1, 1.0, seed=0)   # warm-up: autotuning, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = worker.generate(ids, mask, 1, 1.0, seed=1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    steps = out["response_ids"].shape[1]
    worker = None
    release_memory()
    return float(out["response_mask"].sum()) / elapsed, steps


def vllm_form(arch: str, model_dir: str) -> tuple[str | None, str]:
    """(the directory vLLM serves for `arch`'s model, how), or (None, why not): the hybrid family through its
    Qwen3-Next form (written beside model_dir by rltrain.export's conversion), the others as built."""
    import transformers as tf

    from rltrain.export import write_hf_model

    config = tf.AutoConfig.from_pretrained(model_dir)
    if not isinstance(config, HybridDeltaConfig):
        return model_dir, "as built"
    reason = qwen3_next_refusal(config)
    if reason is not None:
        return None, reason
    weights = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(file))
    out = write_hf_model(weights, Path(model_dir), Path(f"{model_dir}_as_qwen3_next"), "5GB", "bfloat16", "qwen3_next")
    return str(out), "its Qwen3-Next form"


def decode_vllm(serve_dir: str, model_dir: str, args) -> tuple[float, int, float]:
    """(tokens/s, decoding steps, relative error of vLLM's sampled-token log-probs against the actor's on
    model_dir) of the vLLM rollout engine serving serve_dir, in a process of its own: vLLM's sleep-mode allocator
    takes one engine per process."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=vllm_decode_process, args=(serve_dir, model_dir, args, results))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the vLLM decoding process for {serve_dir} exited with {process.exitcode}")
    return results.get()


def vllm_decode_process(serve_dir: str, model_dir: str, args, results) -> None:
    results.put(decode_vllm_here(serve_dir, model_dir, args))


def decode_vllm_here(serve_dir: str, model_dir: str, args) -> tuple[float, int, float]:
    """decode_vllm in this process."""
    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor import ActorWorker
    from rltrain.workers.actor_config import ActorConfig
    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    worker = RolloutWorker(RolloutConfig(engine="vllm", n=1, max_new_tokens=args.decode_len,
                                         gpu_memory_utilization=0.5), serve_dir, "bfloat16", None, device="cuda")
    ids, mask = decode_prompts(args)
    check = worker.generate(ids[:8, :32], mask[:8, :32], 1, 1.0, seed=0)   # also the warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = worker.generate(ids, mask, 1, 1.0, seed=1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    worker.sleep()   # the engine's weights and KV cache off the GPU before the actor loads
    worker = None
    release_memory()
    actor = ActorWorker(ActorConfig(), LossConfig(), model_dir, "bfloat16", AUTO, temperature=1.0, device="cuda")
    valid = check["response_mask"].bool()
    ours = actor.compute_logprobs(check).double()[valid]
    error = ((check["rollout_logprobs"].double()[valid] - ours).norm() / ours.norm()).item()
    actor = None
    release_memory()
    return float(out["response_mask"].sum()) / elapsed, out["response_ids"].shape[1], error


def actor_step(model_dir: str, batch, args, packed: bool = True, mixed_precision: bool = False,
               device: str = "cuda") -> tuple:
    """(params in billions, old log-probs s, update s, peak GiB, applied kernels, the first step's old log-probs) of
    rltrain's actor step on `batch`: two warm-up steps (autotuning, allocator), then the faster of two steps (the
    first at a new size can still autotune a kernel for it)."""
    path = RltrainPath(model_dir, PADDED_ROWS, packed=packed, max_tokens=args.max_tokens if packed else 0,
                       mixed_precision=mixed_precision, device=device)
    params = sum(p.numel() for p in path.model.parameters()) / 1e9
    for warm_batch in (make_batch(8, 64, 128, 256, seed=1), make_batch(8, 96, 300, 600, seed=2)):
        timed_step(path, warm_batch)
    torch.cuda.reset_peak_memory_stats()
    steps = [timed_step(path, batch) for _ in range(2)]
    old_s, update_s, _ = min(steps, key=lambda step: step[0] + step[1])
    peak = torch.cuda.max_memory_allocated() / 2**30
    kernels = sorted(get_applied_kernels(path.model))
    path = None
    release_memory()
    return params, old_s, update_s, peak, kernels, steps[0][2]


def decode_row(arch: str, model_dir: str, engines: list[str], args) -> list:
    """[arch, served as, hf tok/s, steps, vllm tok/s, vllm log-prob rel. err] (0 / None where an engine did not run)."""
    row = [arch, "-", 0.0, 0, 0.0, None]
    if "hf" in engines:
        row[2], row[3] = decode(model_dir, args)
        print(f"  {arch}: hf decode {row[2]:.0f} tok/s over {row[3]} steps", flush=True)
    if "vllm" in engines:
        serve_dir, row[1] = vllm_form(arch, model_dir)
        if serve_dir is None:
            print(f"  {arch}: vLLM cannot serve it: {row[1]}", flush=True)
            row[1] = "no vLLM form"
        else:
            row[4], steps, row[5] = decode_vllm(serve_dir, model_dir, args)
            print(f"  {arch}: vllm ({row[1]}) decode {row[4]:.0f} tok/s over {steps} steps; its log-probs vs the "
                  f"actor's: relative error {row[5]:.1e}", flush=True)
    return row


def print_decode_table(decodes: list[list]) -> None:
    print(f"\n### Decoding, HF engine vs vLLM, bf16, {torch.cuda.get_device_name()}\n")
    print("| arch | vLLM serves | hf tok/s | vllm tok/s | vllm / hf | vllm log-probs vs actor rel. err |")
    print("|---|---|---:|---:|---:|---:|")
    for arch, served, hf, _, vllm, error in decodes:
        ratio = f"{vllm / hf:.2f}x" if hf and vllm else "-"
        print(f"| {arch} | {served} | {f'{hf:.0f}' if hf else '-'} | {f'{vllm:.0f}' if vllm else '-'} | {ratio} | "
              f"{'-' if error is None else f'{error:.1e}'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="qwen3,hybrid,gdp,iplr", help="of qwen3, hybrid, gdp, iplr, qwen3_next")
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--mean-len", type=float, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=16384, help="packed micro-batch token budget")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=256)
    parser.add_argument("--engines", default="hf", help="decoding engines, of hf, vllm (module docstring)")
    parser.add_argument("--decode-only", action="store_true", help="skip the actor steps")
    args = parser.parse_args()
    engines = args.engines.split(",")
    if set(engines) - {"hf", "vllm"}:
        parser.error(f"--engines {args.engines!r}: expected a comma-separated list of hf, vllm")
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    root = tempfile.mkdtemp()
    batch = make_batch(args.responses, args.prompt_len, args.mean_len, args.max_len)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    print(f"actor batch: {args.responses} responses, {tokens} tokens (max response {batch['response_ids'].shape[1]})")
    rows, decodes, mask = [], [], batch["response_mask"].bool()
    for arch in args.archs.split(","):
        model_dir = build_model_dir(arch, root)
        if args.decode_only:
            decodes.append(decode_row(arch, model_dir, engines, args))
            continue
        error = kernel_vs_torch_error(model_dir) if arch != "qwen3" else None
        # qwen3_next: packed, then padded, at mixed precision; the others packed, bf16 in place (as in RESULTS.md)
        layouts = {"qwen3_next packed": True, "qwen3_next padded": False} if arch == "qwen3_next" else {arch: True}
        logps = {}
        for name, packed in layouts.items():
            params, old_s, update_s, peak, kernels, logps[name] = actor_step(model_dir, batch, args, packed,
                                                                             mixed_precision=arch == "qwen3_next")
            rows.append([name, params, tokens / (old_s + update_s), old_s, update_s, peak, None, 0, error, ""])
            print(f"  {name}: {params:.2f}B params, actor {rows[-1][2]:.0f} tok/s (old {old_s:.2f} s, update "
                  f"{update_s:.2f} s, peak {peak:.1f} GiB)"
                  + (f", kernels vs torch log-prob rel. error {error:.1e}" if error is not None else "")
                  + f"; kernels {', '.join(kernels)}", flush=True)
        if len(logps) == 2:   # packed against padded: the same model, the same step
            (_, packed_logps), (_, padded_logps) = logps.items()
            err = ((packed_logps - padded_logps)[mask].norm() / padded_logps[mask].norm()).item()
            rows[-2][9] = f"{rows[-2][2] / rows[-1][2]:.2f}x padded's tok/s; old log-probs vs padded {err:.1e}"
            rows[-1][9] = f"{PADDED_ROWS} rows/micro-batch"
            print(f"  old log-probs {arch} packed vs padded: relative error {err:.2e}")
        row = rows[-len(layouts)]   # decoding: once per arch, on its first row
        decodes.append(decode_row(arch, model_dir, engines, args))
        row[6], row[7] = decodes[-1][2] or None, decodes[-1][3]
    if "vllm" in engines:
        print_decode_table(decodes)
    if args.decode_only:
        return
    base = {r[0]: r for r in rows}.get("qwen3")
    print(f"\n### Delta-rule policies vs Qwen3, bf16, {torch.cuda.get_device_name()}\n")
    print("| arch | params | actor tok/s | vs qwen3 | old log-probs s | update s | peak GiB | decode tok/s "
          "| vs qwen3 | kernels vs torch rel. err | note |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, params, tps, old_s, update_s, peak, dtps, steps, error, note in rows:
        same_shape = base is not None and not name.startswith("qwen3_next")   # qwen3_next: another shape
        vs = (f"{tps / base[2]:.2f}x", f"{dtps / base[6]:.2f}x" if dtps else "-") if same_shape else ("-", "-")
        print(f"| {name} | {params:.2f}B | {tps:.0f} | {vs[0]} | {old_s:.2f} | {update_s:.2f} | {peak:.1f} | "
              f"{f'{dtps:.0f}' if dtps else '-'} | {vs[1]} | {'-' if error is None else f'{error:.1e}'} | {note} |")


if __name__ == "__main__":
    main()
