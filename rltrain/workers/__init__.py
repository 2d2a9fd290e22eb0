"""The roles, as plain classes the controller wraps in Ray actors: ActorWorker (trains, old log-probs),
RolloutWorker (generates), ReferenceWorker (frozen log-probs for KL), RewardWorker (scores). Each takes its own
typed config slice. Batches between them are tensordict.TensorDicts with the field names in batch.py."""
