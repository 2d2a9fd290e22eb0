"""GRPOTrainer.close without Ray: with a worker already dead (its close raises) every other worker, placement group
and the output directory's lock are still released, and the failures are reported once, together."""

import logging

import pytest

from rltrain import trainer as trainer_module
from rltrain.trainer import GRPOTrainer


class _Part:
    """A stand-in for what close() stops: records its method calls (`part.method()`, or a Ray actor's
    `part.method.remote()`), raising on the methods named in `fails`."""

    def __init__(self, name: str, calls: list, fails=()):
        self.name, self.calls, self.fails = name, calls, fails

    def __getattr__(self, method):
        part = self

        class Method:
            def __call__(self, *args, **kwargs):
                part.calls.append(f"{part.name}.{method}")
                if method in part.fails:
                    raise RuntimeError(f"{part.name} is dead")

            def remote(self, *args, **kwargs):
                part.calls.append(f"{part.name}.{method}.remote")
                return f"ref of {part.name}.{method}"

        return Method()


def _trainer(monkeypatch, calls: list) -> GRPOTrainer:
    """A trainer as a started run leaves it, its Ray calls recorded: the reward worker has died, so asking it to close
    its pool fails, and so does one rollout process's kill."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    for name in ("tracker", "actor", "reference", "teacher", "placement", "rollout_placement", "lock"):
        setattr(trainer, name, _Part(name, calls))
    trainer.rollout = _Part("rollout", calls, fails=("kill",))
    trainer.reward = _Part("reward", calls)

    def get(ref, timeout=None):
        calls.append("ray.get")
        raise RuntimeError("the actor died unexpectedly before finishing this task")

    monkeypatch.setattr(trainer_module.ray, "get", get)
    monkeypatch.setattr(trainer_module, "kill", lambda handle: calls.append(f"kill {handle.name}"))
    return trainer


EVERYTHING = ["tracker.close", "reward.close.remote", "ray.get", "rollout.kill", "kill actor", "kill reference",
              "kill teacher", "kill reward", "placement.remove", "rollout_placement.remove", "lock.release"]


def test_close_stops_everything_when_a_worker_is_dead_and_reports_the_failures_once(monkeypatch):
    calls = []
    trainer = _trainer(monkeypatch, calls)
    with pytest.raises(RuntimeError) as raised:
        trainer.close()
    assert calls == EVERYTHING
    assert str(raised.value) == ("closing the run: 2 step(s) failed; reward pool: RuntimeError: the actor died "
                                 "unexpectedly before finishing this task; rollout: RuntimeError: rollout is dead")
    trainer.close()  # a second close does nothing
    assert calls == EVERYTHING


def test_close_after_the_runs_own_error_logs_its_failures(monkeypatch, caplog):
    calls = []
    trainer = _trainer(monkeypatch, calls)
    trainer.close(raise_errors=False)  # the run's error, being raised, is the one to report
    assert calls == EVERYTHING
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage().startswith("closing the run: 2 step(s) failed; reward pool: ")
