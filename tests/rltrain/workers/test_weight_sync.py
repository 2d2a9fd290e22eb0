"""The weight push's pieces (rltrain/workers/weight_sync.py), without Ray: the flat bucket layout round-trips every
dtype and shape; the pairing of rollout processes with actor ranks by GPU UUID; a bucket whose GPU the receiver does
not see falls back to its host copy (the CPU-testable side of the IPC route), and with no host copy it fails loudly;
a host copy is one flat array that gives views of itself or a private copy; on CPU an actor exports only a host
copy, on rank 0 only; a tied weight goes once and reaches both names.

@pytest.mark.gpu: host copies from a GPU through the pinned staging buffer; the IPC route for real on one GPU — an
ActorWorker in this process and a RolloutWorker (hf engine) in a spawned one, as Ray colocates them; every bucket
arrives by IPC and the engine's log-probs of a fixed batch equal the actor's after the push. This module imports no
Ray (a GPU machine without internet access gets Ray only as benchmarks/README.md describes)."""

import multiprocessing
import pickle
import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.config import LossConfig
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.weight_sync import (
    ALIGN_BYTES, ExportedBucket, HostBuffer, IpcBuffer, pack, plan_layout, plan_sources, receive, unpack,
)
from tests.rltrain.tiny_job import save_tiny_policy


def test_flat_buffer_round_trips_dtypes_and_shapes():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(2.5),
               "ids": torch.arange(5), "flags": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4),
               "half": torch.randn(2, 3).half(), "strided": torch.randn(4, 6).t()}
    buffer, slots = pack(tensors, "cpu")
    assert buffer.dtype == torch.uint8 and [s.name for s in slots] == list(tensors)
    assert all(slot.offset % ALIGN_BYTES == 0 for slot in slots)
    assert buffer.numel() == plan_layout(tensors)[1] < len(tensors) * ALIGN_BYTES + sum(s.nbytes for s in slots)
    out = unpack(buffer, slots)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(out[name], tensor), name
    out["a"].fill_(0)  # views into the buffer, not copies
    assert torch.equal(unpack(buffer, slots)["a"], torch.zeros(3, 5))


def test_rollout_processes_pair_with_the_actor_rank_on_their_gpu():
    assert plan_sources(["g0", "g1", "g2", "g3"], ["g0", "g1", "g2", "g3"]) == [0, 1, 2, 3]
    assert plan_sources(["g0", "g1"], ["g1", "g0", "g9"]) == [1, 0, None]   # by UUID, not by index; g9: host
    assert plan_sources(["g0", "g0"], ["g0"]) == [0]                          # the lowest rank on that GPU
    assert plan_sources([None], [None, None]) == [None, None]                 # CPU: every process by host


def test_host_buffer_gives_views_or_a_private_copy_of_a_read_only_array():
    """As Ray's object store hands it over: a read-only array. Views of it by default (no copy, no warning),
    a writable private copy with own=True; the values round-trip either way."""
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16)}
    buffer, slots = pack(tensors, "cpu")
    host = HostBuffer(np.frombuffer(buffer.numpy().tobytes(), dtype=np.uint8), slots)  # read-only, like ray.get's
    assert not host.data.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        views = host.tensors()
    owned = host.tensors(own=True)
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor) and torch.equal(owned[name], tensor), name
    owned["w"].fill_(0)  # a private copy: the array is unchanged
    assert torch.equal(host.tensors()["w"], tensors["w"])


def test_a_bucket_on_an_unseen_gpu_falls_back_to_its_host_copy():
    weights = {"w": torch.randn(2, 2)}
    buffer, slots = pack(weights, "cpu")
    host = HostBuffer(buffer.numpy(), slots)
    unseen = IpcBuffer(uuid="GPU-00000000-not-here", handle=(None, ()), slots=[])
    tensors, route = receive(ExportedBucket(ipc=unseen, host=host), own=True)
    assert route == "host" and torch.equal(tensors["w"], weights["w"])
    tensors, route = receive(ExportedBucket(host=host), own=False)
    assert route == "host" and torch.equal(tensors["w"], weights["w"])
    with pytest.raises(RuntimeError, match="GPU-00000000-not-here.*no host copy"):
        receive(ExportedBucket(ipc=unseen), own=False)


def _model_dir(path) -> str:
    save_tiny_policy(path)
    return str(path)


def _actor(model_dir, device="cpu") -> ActorWorker:
    return ActorWorker(ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None, temperature=1.0,
                       device=device)


def test_cpu_actor_exports_a_host_copy_from_rank_0_only(tmp_path):
    actor = _actor(_model_dir(tmp_path))
    names = actor.bucket_names(1)[0]
    bucket = actor.export_weights(names, ipc_ranks=[], host=True)
    assert bucket.ipc is None and isinstance(bucket.host.data, np.ndarray)
    exported, state = bucket.host.tensors(), actor.model.state_dict()
    assert list(exported) == names and all(torch.equal(exported[name], state[name]) for name in names)
    actor.rank = 1  # as an FSDP2 rank other than 0 would be: nothing to send
    assert actor.export_weights(names, ipc_ranks=[], host=True) is None


def test_a_tied_weight_is_pushed_once_and_the_engine_head_follows_it(tmp_path):
    """A Qwen3 with tied embeddings (as Qwen3-0.6B): the push leaves out lm_head.weight, and after it every entry of
    the transformers engine's state_dict, its head included, equals the updated actor's."""
    import transformers as tf

    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    model_dir = _model_dir(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(model_dir)  # the embedding once, as a tied checkpoint is saved
    actor = _actor(model_dir)
    assert actor.model.lm_head.weight is actor.model.model.embed_tokens.weight
    buckets = actor.bucket_names(1)
    names = [name for bucket in buckets for name in bucket]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert set(names) == set(actor.model.state_dict()) - {"lm_head.weight"}
    with torch.no_grad():  # an update: the engine's load is checked against weights it never had
        for param in actor.model.parameters():
            param.add_(torch.randn_like(param))
    rollout = RolloutWorker(RolloutConfig(torch_threads=1), model_dir, "float32", None, device="cpu")
    rollout.begin_weight_update()
    for bucket in buckets:
        rollout.load_bucket(actor.export_weights(bucket, ipc_ranks=[], host=True))
    rollout.finish_weight_update()
    pushed, expected = rollout.engine.model.state_dict(), actor.model.state_dict()
    assert set(pushed) == set(expected)
    assert all(torch.equal(pushed[name], expected[name]) for name in expected)


def _fixed_batch(vocab: int) -> TensorDict:
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, vocab, (3, 5), generator=generator)
    response_ids = torch.randint(4, vocab, (3, 6), generator=generator)
    response_mask = torch.ones(3, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    return TensorDict({"prompt_ids": prompt_ids, "prompt_mask": torch.ones(3, 5, dtype=torch.long),
                       "response_ids": response_ids, "response_mask": response_mask}, batch_size=[3])


def _rollout_process(model_dir: str, connection) -> None:
    """The receiving side, in its own process as Ray would run it: a RolloutWorker (hf engine) on the GPU."""
    from rltrain.workers.packing import MicroBatching
    from rltrain.workers.policy import response_logprobs
    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    rollout = RolloutWorker(RolloutConfig(torch_threads=1), model_dir, "float32", None, device="cuda")
    connection.send(rollout.device_info())
    rollout.begin_weight_update()
    while (bucket := connection.recv()) is not None:
        connection.send(rollout.load_bucket(bucket))  # the route it took
    rollout.finish_weight_update()
    batch = _fixed_batch(rollout.engine.model.config.vocab_size)
    # numpy pickles by value: a tensor would go by a shared-memory handle, which needs this process alive
    connection.send(response_logprobs(rollout.engine.model, batch, 1.0, MicroBatching(rows=8, packed=False)).numpy())


@pytest.mark.gpu
def test_ipc_push_on_one_gpu(tmp_path):
    model_dir = _model_dir(tmp_path)
    actor = _actor(model_dir, device="cuda")
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    context = multiprocessing.get_context("spawn")
    connection, child_end = context.Pipe()
    child = context.Process(target=_rollout_process, args=(model_dir, child_end))
    child.start()
    try:
        assert connection.recv() == actor.device_info()  # the same GPU, by UUID
        buckets = [[name] for bucket in actor.bucket_names(1) for name in bucket]  # a tensor each: many buckets
        for names in buckets:
            connection.send(actor.export_weights(names, ipc_ranks=[0], host=False))
            assert connection.recv() == "ipc"  # the receiver is done with this buffer before the next export
        actor.release_weights()
        connection.send(None)
        engine_logprobs = torch.from_numpy(connection.recv())
    finally:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    batch = _fixed_batch(actor.model.config.vocab_size)  # the batch the rollout process scored
    valid = batch["response_mask"].bool()
    actor_logprobs = actor.compute_logprobs(batch)
    assert (engine_logprobs - actor_logprobs).abs()[valid].max() < 1e-3
    stale = _actor(model_dir, device="cuda").compute_logprobs(batch)  # the check discriminates
    assert (stale - actor_logprobs).abs()[valid].mean() > 0.05


@pytest.mark.gpu
def test_host_copies_from_a_gpu_go_through_one_pinned_staging_buffer(tmp_path):
    """Each host export is read (pickled, as Ray's object store copies a return value) before the next export
    reuses the staging buffer; every bucket arrives with the actor's values."""
    actor = _actor(_model_dir(tmp_path), device="cuda")
    buckets = [[name] for bucket in actor.bucket_names(1) for name in bucket]
    sent = [pickle.dumps(actor.export_weights(names, ipc_ranks=[], host=True)) for names in buckets]
    assert actor._staging.is_pinned()
    state = actor.model.state_dict()
    for names, payload in zip(buckets, sent):
        tensors, route = receive(pickle.loads(payload), own=False, device="cuda")
        assert route == "host" and all(torch.equal(tensors[name], state[name]) for name in names), names
