"""Asynchronous RL (trainer.mode): a producer thread in the controller generates and scores the steps' batches
while the actor trains, keeping them in a bounded queue, so the rollout engines and the actor work at the same time.

Versions. The weights the run starts from are version v0 (the step a resumed run starts after); step t's update makes
version t. Step t trains the policy of version t − 1, so a response sampled by version v trains with a lag of
(t − 1) − v versions: 0 in `sync`, where every step generates on the weights its update starts from.

- `one_step_off`: step t's batch is sampled by version max(v0, t − 2), exactly: it is generated while the actor
  trains step t − 1. The lag is 1 after the run's (or the resumed run's) first step, and a run replays exactly.
- `async` with trainer.max_staleness = k: step t's batch is sampled by the newest version published when its
  generation starts, and that starts only once version t − 1 − k is out, so the lag is at most k; the queue holds at
  most k batches (with the one being generated).

The producer takes weights only between two batches (`RolloutProducer._run`): a snapshot of version v
(WeightPush.snapshot, host copies in Ray's object store, taken as the update ends) is loaded into the engines under
the engine lock, which every generation holds too, so a push never races a generation in flight. Validation runs
under the same lock on the newest version (`with_weights`). The trainer checks every batch's lag against the mode's
bound (`check_lag`) and logs rollout/version_lag_mean and _max; batch["weight_version"] holds each response's version.

Partial rollouts (rollout.partial, async only): a push reaches the generation in flight. On the vllm engine
(rollout.mode=async) every response is one request that runs until it ends; while they run, the replicas' wait calls
`RolloutProducer.refresh` (under the engine lock the producer holds), whose load of a newer version aborts the requests
in flight, and the update's finish resumes them as prompt + tokens so far on the new weights
(rltrain/workers/interruptible.py, RolloutReplicas.generate_partial). The hf engine has no async engine: a batch is
generated in segments of rollout.partial_segment_tokens new tokens (`generate_in_segments`), refresh() loading the
newest version between two segments, and the unfinished responses continue from their prompt + the tokens so far.
batch["token_versions"] [B, R] holds the version that sampled each token (0 past a response's end), and
rollout_logprobs are each token's under that version: the behaviour policy the off-policy corrections need, token by
token. weight_version is then a response's oldest token's version, which the bound k applies to (newer tokens lag
less); the trainer checks every token's lag and logs rollout/version_lag_mean and _max over tokens.

Scoring. Where nothing waits on a batch's rewards before the next rollout (no dynamic sampling, which reads a round's
rewards to decide on another), the trainer hands a batch's scoring (function, reward model, judge) to a thread of its
own and the producer goes on to the next batch's rollout at once: ProducedBatch.scored, which take() waits for.

Checkpoints record the mode and the steps queued or in flight; a resumed run drops them (a log line says how many
groups) and generates those steps again, from the same prompts (the checkpoint's sampler position is the last trained
batch's), on the checkpoint's weights.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rltrain.rewards.health import RewardStats

logger = logging.getLogger(__name__)

MODES = ("sync", "one_step_off", "async")


def staleness_bound(mode: str, max_staleness: int) -> int:
    """The largest version lag the mode allows: 0 (sync), 1 (one_step_off), trainer.max_staleness (async)."""
    return {"sync": 0, "one_step_off": 1}.get(mode, max_staleness)


def check_lag(mode: str, max_staleness: int, step: int, first_version: int, versions: torch.Tensor) -> torch.Tensor:
    """The lags (step − 1) − versions of step `step`'s responses, checked against the mode: one_step_off's exact
    lag (0 on the first step after first_version, else 1), async's bound k; raises RuntimeError otherwise."""
    lags = (step - 1) - versions.long()
    if mode == "one_step_off":
        expected = (step - 1) - max(first_version, step - 2)
        ok = bool((lags == expected).all())
        bound = f"exactly {expected}"
    else:
        bound_k = staleness_bound(mode, max_staleness)
        ok = bool(((lags >= 0) & (lags <= bound_k)).all())
        bound = f"in [0, {bound_k}]"
    if not ok:
        raise RuntimeError(f"trainer.mode={mode}: step {step} got responses of weight versions "
                           f"{sorted(set(versions.tolist()))}, lags {sorted(set(lags.tolist()))}; the mode allows "
                           f"lags {bound}")
    return lags


def warn_uncorrected(job) -> None:
    """One log line when an off-policy run has nothing correcting for the stale behaviour policy (algorithm.old_logprobs
    actor with neither algorithm.loss.decoupled nor algorithm.rollout_correction): its ratio is then against the
    actor's recomputed policy only, as if the responses had been sampled by it."""
    algorithm = job.algorithm
    if job.old_logprobs == "actor" and not algorithm.loss.decoupled and algorithm.rollout_correction.mode is None:
        logger.warning("trainer.mode=%s trains on responses sampled up to %d weight version(s) back, with the ratio "
                       "against the actor's recomputed log-probs and no behaviour-policy correction: set "
                       "algorithm.loss.decoupled=true (AReaL), algorithm.rollout_correction.mode (TIS / MIS) or "
                       "algorithm.old_logprobs=rollout", job.trainer.mode,
                       staleness_bound(job.trainer.mode, job.trainer.max_staleness))


def token_lags(mode: str, max_staleness: int, step: int, first_version: int, batch: TensorDict) -> torch.Tensor:
    """The lags check_lag returns, per response (batch["weight_version"]), or with partial rollouts
    (batch["token_versions"]) per response token, every token checked against the mode's bound."""
    if "token_versions" not in batch.keys():
        return check_lag(mode, max_staleness, step, first_version, batch["weight_version"])
    return check_lag(mode, max_staleness, step, first_version,
                     batch["token_versions"][batch["response_mask"].bool()])


def oldest_versions(token_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's oldest token's version [B] (a response has at least one token)."""
    big = torch.iinfo(torch.long).max
    return torch.where(response_mask.bool(), token_versions.long(), big).amin(1)


def generate_in_segments(generate: Callable[..., TensorDict], refresh: Callable[[], int], prompt_ids: torch.Tensor,
                         prompt_mask: torch.Tensor, n: int, temperature: float, seed: int, max_new_tokens: int,
                         segment_tokens: int, pad_token_id: int) -> TensorDict:
    """A partial rollout: generate(ids, mask, n, temperature, seed, max_new_tokens) (RolloutReplicas.generate) in
    segments of segment_tokens new tokens. Before every segment refresh() loads the newest weights if newer ones are
    out and returns the version the engines hold; the unfinished responses (no <eos> yet, below max_new_tokens)
    continue as one response each (n = 1) from prompt + tokens so far, seeded per segment. The batch is the engine's
    fields plus token_versions [B, R] (0 past a response's end)."""
    version = refresh()
    first = generate(prompt_ids, prompt_mask, n, temperature, seed, min(segment_tokens, max_new_tokens))
    rows = first.batch_size[0]
    response = torch.full((rows, max_new_tokens), pad_token_id, dtype=first["response_ids"].dtype)
    mask = torch.zeros((rows, max_new_tokens), dtype=first["response_mask"].dtype)
    versions = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    logprobs = torch.zeros((rows, max_new_tokens)) if "rollout_logprobs" in first.keys() else None
    truncated = first["truncated"].clone()
    active, done, segment, out = torch.arange(rows), 0, 0, first
    while True:
        width = out["response_ids"].shape[1]
        response[active, done:done + width] = out["response_ids"]
        mask[active, done:done + width] = out["response_mask"]
        versions[active, done:done + width] = version * out["response_mask"].long()
        if logprobs is not None:
            logprobs[active, done:done + width] = out["rollout_logprobs"].float()
        truncated[active] = out["truncated"]
        done += width
        # still generating: no <eos> yet (an unfinished row got the segment's full width) and room left
        active = active[out["truncated"]]
        if done >= max_new_tokens or active.numel() == 0:
            break
        segment += 1
        version = refresh()
        ids = torch.cat([first["prompt_ids"][active], response[active, :done]], 1)
        ids_mask = torch.cat([first["prompt_mask"][active], mask[active, :done].to(first["prompt_mask"].dtype)], 1)
        out = generate(ids, ids_mask, 1, temperature, seed * 1_000_003 + segment,
                       min(segment_tokens, max_new_tokens - done))
    width = int(mask.sum(1).max()) if rows else 0
    fields = {key: first[key] for key in ("prompt_ids", "prompt_mask", "group_ids")}
    fields.update(response_ids=response[:, :width], response_mask=mask[:, :width], truncated=truncated,
                  token_versions=versions[:, :width])
    if logprobs is not None:
        fields["rollout_logprobs"] = logprobs[:, :width]
    return TensorDict(fields, batch_size=[rows])


def lag_metrics(lags: torch.Tensor) -> dict[str, float]:
    return {"rollout/version_lag_mean": float(lags.double().mean()), "rollout/version_lag_max": float(lags.max())}


def dropped_on_resume(state: dict, n: int) -> str:
    """The log line of a resume from a checkpoint whose producer had batches queued or in flight (its
    trainer_state.json "pending": {step: responses, -1 = being generated}), which the resumed run drops."""
    pending = {int(step): responses for step, responses in state["pending"].items()}
    queued = {step: responses for step, responses in pending.items() if responses >= 0}
    in_flight = sorted(step for step, responses in pending.items() if responses < 0)
    groups = sum(queued.values()) // n
    flight = f", and step {in_flight[0]}'s batch was being generated" if in_flight else ""
    return (f"resume: the checkpoint of step {state['step']} (trainer.mode={state.get('mode', 'sync')}) had "
            f"{groups} scored group(s) queued (steps {sorted(queued) or 'none'}){flight}; dropped: this run "
            "generates those steps again, from the same prompts, on the checkpoint's weights")


@dataclass
class ProducedBatch:
    """One step's scored groups as the producer hands them over."""
    step: int                      # the step that trains on it
    batch: TensorDict              # as the sync path collects it, plus weight_version [B]
    extras: list                   # the reward functions' extra numbers, per response
    errors: RewardStats            # reward errors, by kind
    prompts: int                   # prompts sampled (dynamic sampling may take several rounds)
    seconds: dict[str, float]      # the producer's phases: rollout, reward, weight_load
    counts: dict[str, float]       # rollout_tokens
    sampler_state: dict            # the prompt sampler right after this batch's prompts
    version: int = -1              # the weights that sampled it
    scored: Future | None = None   # its scoring, still running beside the next rollout: batch["rewards"], extras,
                                   # errors and seconds["reward"] are filled in when it is done (take() waits)


class RolloutProducer:
    """Generates steps[0], steps[1], ... in order on a thread of its own. generate(step) -> ProducedBatch (the
    trainer's sampling, rollout and scoring of that step); load_weights(snapshot, version) -> seconds, into the engines.
    generate may call refresh() during a partial rollout (the newest weights, loaded: vLLM's requests in flight are
    aborted and resumed on them, the hf engine's next segment starts on them).
    The trainer calls publish(version, snapshot) after each update, take(step) for each step's batch,
    with_weights(version, fn) to run fn on the engines with that version loaded, and stop() at the end."""

    def __init__(self, generate: Callable[[int], ProducedBatch], load_weights: Callable[[object], float],
                 steps: range, first_version: int, mode: str, max_staleness: int):
        self.generate, self.load_weights, self.steps = generate, load_weights, steps
        self.mode, self.bound = mode, staleness_bound(mode, max_staleness)
        self.first_version = first_version
        self._cond = threading.Condition()
        self._engine = threading.Lock()           # held while the engines load weights or generate
        self._queue: deque[ProducedBatch] = deque()
        self._snapshots: dict[int, object] = {}   # published versions the producer (or validation) may still load
        self._published = self._loaded = first_version
        self._in_flight: int | None = None        # the step being generated, and the version it was given
        self._chosen: int | None = None
        self._error: BaseException | None = None
        self._refresh_s = 0.0                     # seconds of the batch in flight's loads between segments
        self._stopping = self._finished = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> RolloutProducer:
        self._thread.start()
        return self

    def needed(self, step: int) -> int:
        """The oldest version step `step`'s batch may be sampled by (one_step_off: the one it is sampled by)."""
        return max(self.first_version, step - 1 - self.bound)

    # ---------------------------------------------------------------- the producer's thread
    def _run(self) -> None:
        try:
            for step in self.steps:
                need = self.needed(step)
                with self._cond:  # the queue's bound alone keeps the lag <= bound; the version wait guards it
                    self._cond.wait_for(lambda: self._stopping or (len(self._queue) < self.bound
                                                                   and self._published >= need))
                    if self._stopping:
                        return
                    version = need if self.mode == "one_step_off" else self._published
                    self._in_flight, self._chosen = step, version
                with self._engine:
                    self._refresh_s = 0.0
                    load_s = self._ensure_loaded(version)
                    item = self.generate(step)
                item.version, item.seconds["weight_load"] = version, load_s + self._refresh_s
                if "token_versions" in item.batch.keys():  # partial rollouts: a response's oldest token's version
                    item.batch["weight_version"] = oldest_versions(item.batch["token_versions"],
                                                                   item.batch["response_mask"])
                else:
                    item.batch["weight_version"] = torch.full((item.batch.batch_size[0],), version, dtype=torch.long)
                with self._cond:
                    self._queue.append(item)
                    self._in_flight = self._chosen = None
                    self._prune(step + 1)
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer's next take()
            logger.exception("rollout producer failed")
            with self._cond:
                self._error, self._in_flight = err, None
        finally:  # a take() waiting for a batch that will not come wakes up and says so
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _ensure_loaded(self, version: int) -> float:
        """Load `version` into the engines unless they hold it (the engine lock is held); seconds."""
        if version == self._loaded:
            return 0.0
        with self._cond:
            snapshot = self._snapshots[version]
        seconds = self.load_weights(snapshot, version)
        self._loaded = version
        return seconds

    def refresh(self) -> int:
        """Partial rollouts, between two segments of the producer's generation (on its thread, the engine lock held):
        load the newest published version if the engines hold an older one; the version they hold."""
        with self._cond:  # the snapshot is taken with the version: a publish meanwhile may prune it
            newest = self._published
            snapshot = self._snapshots[newest] if newest > self._loaded else None
        if snapshot is not None:
            self._refresh_s += self.load_weights(snapshot, newest)
            self._loaded = newest
        return self._loaded

    def _prune(self, next_step: int) -> None:
        """Drop snapshots nobody will load: below what the next batch needs (one_step_off), or all but the newest
        (async, which always takes the newest). The newest stays for validation, the in-flight batch's until it is
        loaded."""
        keep_from = min(self.needed(next_step) if self.mode == "one_step_off" else self._published, self._published)
        for version in [v for v in self._snapshots if v < keep_from and v != self._chosen]:
            del self._snapshots[version]

    # ---------------------------------------------------------------- the trainer's side
    def publish(self, version: int, snapshot) -> None:
        """Version `version` of the weights (WeightPush.snapshot) is out: the producer may load it."""
        with self._cond:
            self._snapshots[version] = snapshot
            self._published = version
            self._prune(self._in_flight or self._next_step())
            self._cond.notify_all()

    def _next_step(self) -> int:
        return self._queue[-1].step + 1 if self._queue else self.steps.start

    def take(self, step: int) -> ProducedBatch:
        """Step `step`'s batch, waiting for it; re-raises the producer's error."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._error is not None or self._finished)
            if self._error is not None:
                raise RuntimeError("the rollout producer failed (its traceback is logged above)") from self._error
            if not self._queue:
                raise RuntimeError(f"the rollout producer stopped before step {step}'s batch")
            item = self._queue.popleft()
            self._cond.notify_all()
        if item.step != step:
            raise RuntimeError(f"the rollout producer handed step {item.step}'s batch to step {step}")
        if item.scored is not None:
            try:
                item.scored.result()
            except BaseException as err:
                raise RuntimeError(f"scoring step {step}'s batch failed") from err
        return item

    def with_weights(self, version: int, fn: Callable[[], object]):
        """fn() on the engines holding version `version` (between two of the producer's batches)."""
        with self._engine:
            self._ensure_loaded(version)
            return fn()

    def pending(self) -> dict[int, int]:
        """{step: responses} of the batches queued, and of the one being generated (-1: not known yet)."""
        with self._cond:
            out = {item.step: item.batch.batch_size[0] for item in self._queue}
            if self._in_flight is not None:
                out[self._in_flight] = -1
            return out

    def stop(self, timeout_s: float = 600.0) -> None:
        """Stop after the batch in flight (if any) and wait for the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
