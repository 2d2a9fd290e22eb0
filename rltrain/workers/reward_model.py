"""The reward model (reward.model.path): a transformers sequence-classification checkpoint (one label) that scores
each (prompt, response) with its own tokenizer and chat template, in a Ray process placed with the model roles. The
trainer adds its score, weighted, to the reward function's: reward = rule_weight · rule + weight · model, with
reward/rule_mean and reward/model_mean logged per step.

A conversation is the row's prompt (text as one user message, or its chat messages) and the response as the
assistant's message (a multi-turn episode: its own messages), rendered with the reward model's chat template, or
as plain prompt + response text where it has none. Each conversation's score is the `score` head's output at its last
token, so it does not depend on a pad token id that a model's own pooling would look for; the conversation is cut from
the left to reward.model.max_length tokens, keeping the response.

Batches are packed like the actor's (reward.model.use_remove_padding): conversations laid back to back in one row per
micro-batch of at most reward.model.max_tokens_per_micro_batch tokens, variable-length attention keeping them apart
(rltrain/workers/attention.py), the head applied at each one's last token. With packing off, or a model whose layers
take no sequence boundaries, micro-batches of reward.model.micro_batch_size right-padded rows (the head's per-token
output taken by a forward hook).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import logging

import torch
import torch.distributed as dist
import transformers as tf

from rltrain.config import ConfigError, require
from rltrain.workers.attention import use_packed_attention, varlen_kwargs
from rltrain.workers.fsdp import FSDPConfig, init_distributed, shard_policy
from rltrain.workers.packing import balanced_groups, token_budget_groups
from rltrain.workers.group import PLACEMENTS
from rltrain.workers.hf_config import from_pretrained
from rltrain.workers.policy import DTYPES, can_pack, load_tokenizer, release_cached_memory, set_threads

logger = logging.getLogger(__name__)


@dataclass
class RewardModelConfig:
    path: str | None = None    # a sequence-classification checkpoint with one label; null = no reward model
    weight: float = 1.0        # its score's weight in the reward
    rule_weight: float = 1.0   # the reward function's weight (0: the reward model alone)
    micro_batch_size: int = 8  # padded: conversations per forward pass
    max_length: int = 4096     # tokens of a conversation the model reads (cut from the left)
    use_remove_padding: bool = True          # pack each micro-batch's conversations into one row (no padding)
    max_tokens_per_micro_batch: int = 16384  # packed: tokens per forward pass; 0 = micro_batch_size conversations
    placement: str = "colocated"   # colocated (a share of the model roles' GPUs) | separate (GPUs of its own)
    n_gpus: int = 1                # separate: its GPUs (CPUs on CPU runs), on one node; FSDP2 over them when > 1

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def validate(self):
        if self.path is None:
            return
        require((Path(self.path).expanduser() / "config.json").is_file(), "path",
                "must be a model directory holding config.json", self.path)
        require(math.isfinite(self.weight), "weight", "must be a finite number", self.weight)
        require(math.isfinite(self.rule_weight), "rule_weight", "must be a finite number", self.rule_weight)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        require(self.max_length >= 2, "max_length", "must be >= 2", self.max_length)
        require(self.placement in PLACEMENTS, "placement", f"must be one of {', '.join(PLACEMENTS)}", self.placement)
        require(self.n_gpus >= 1, "n_gpus", "must be >= 1", self.n_gpus)
        require(self.n_gpus == 1 or self.placement == "separate", "n_gpus", "needs reward.model.placement=separate "
                "(colocated, the reward model takes the model roles' GPUs)", self.n_gpus)
        require(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch", "must be >= 0 (0 = by rows)",
                self.max_tokens_per_micro_batch)


class RewardModelWorker:
    root = None   # FSDPRewardModelWorker: the FSDP2 root every forward goes through

    def __init__(self, config: RewardModelConfig, dtype: str, device: str = "cpu", torch_threads: int = 0):
        set_threads(torch_threads)
        self.config, self.device = config, device
        self._load(config, dtype, device)

    def _load(self, config: RewardModelConfig, dtype: str, device: str) -> None:
        path = str(Path(config.path).expanduser())
        self.tokenizer = load_tokenizer(path, padding_side="right", truncation_side="left")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            model = from_pretrained(tf.AutoModelForSequenceClassification, path, dtype=DTYPES[dtype])
        except (OSError, ValueError) as err:
            raise ConfigError(f"reward.model.path: {path} does not load as a sequence-classification model "
                              f"({err})") from None
        head = getattr(model, "score", None)
        if model.config.num_labels != 1 or not isinstance(head, torch.nn.Linear):
            raise ConfigError(f"reward.model.path: {path} is a {type(model).__name__} with {model.config.num_labels} "
                              "labels; a reward model has one label and a `score` head (Qwen, Llama, Mistral, Gemma "
                              "*ForSequenceClassification)")
        if model.config.pad_token_id is None:  # its own pooling refuses batches without one (the hook's is used)
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(device).eval().requires_grad_(False)
        self.packed = config.use_remove_padding and can_pack(model)
        if self.packed:
            use_packed_attention(model)  # for good: this worker runs packed rows only
        elif config.use_remove_padding:
            logger.warning("reward.model.use_remove_padding: %s has layers that take no sequence boundaries; "
                           "scoring padded rows", type(model).__name__)
        self._token_scores: torch.Tensor | None = None
        head.register_forward_hook(self._keep_token_scores)

    def _keep_token_scores(self, module, inputs, output) -> None:
        self._token_scores = output

    def render(self, prompt: str | list[dict], response: str, messages: list[dict] | None = None) -> str:
        """A conversation as the reward model reads it: its chat template over the messages, else plain text."""
        plain = prompt + response if messages is None and isinstance(prompt, str) else None
        if messages is None:
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + \
                [{"role": "assistant", "content": response}]
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return plain if plain is not None else "\n".join(str(m.get("content", "")) for m in messages)

    def encode(self, prompts: list, responses: list[str], messages: list[list[dict]] | None = None) -> list[list[int]]:
        """Each conversation's token ids, cut from the left to max_length."""
        texts = [self.render(p, r, None if messages is None else m)
                 for p, r, m in zip(prompts, responses, messages or [None] * len(prompts))]
        templated = bool(self.tokenizer.chat_template)  # a template writes its own special tokens
        return self.tokenizer(texts, truncation=True, max_length=self.config.max_length,
                              add_special_tokens=not templated)["input_ids"]

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str], messages: list[list[dict]] | None = None) -> torch.Tensor:
        """The model's score of each (prompt, response), or of each multi-turn episode's messages: [B] float32."""
        ids = self.encode(prompts, responses, messages)
        scores = torch.zeros(len(ids))
        for group in self._micro_batches([len(row) for row in ids]):
            scores[group] = self._forward([ids[i] for i in group])
        release_cached_memory()   # the GPU it shares: the actor trains next, the engine wakes after
        return scores

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        budget, rows = self.config.max_tokens_per_micro_batch, self.config.micro_batch_size
        if self.packed and budget:
            return token_budget_groups(lengths, budget)
        return [list(range(start, min(start + rows, len(lengths)))) for start in range(0, len(lengths), rows)]

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """The scores of these conversations in one forward pass (through the FSDP2 root where there is one)."""
        scores_of = self._packed_scores if self.packed else self._padded_scores
        return scores_of(self.model, rows) if self.root is None else self.root(scores_of, rows)

    def _packed_scores(self, model, rows: list[list[int]]) -> torch.Tensor:
        """One packed row of these conversations: the head at each one's last token."""
        lengths = torch.tensor([len(row) for row in rows])
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(self.device)
        input_ids = torch.tensor([token for row in rows for token in row], device=self.device)[None]
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(self.device)[None]
        hidden = model.base_model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                  **varlen_kwargs(cu_seqlens, int(lengths.max()))).last_hidden_state
        return model.score(hidden[0, cu_seqlens[1:] - 1]).float()[:, 0].cpu()

    def _padded_scores(self, model, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded rows of these conversations: the head's output at each one's last token."""
        encoded = self.tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(self.device)
        model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
        last = encoded["attention_mask"].sum(1) - 1
        return self._token_scores[torch.arange(len(rows), device=last.device), last, 0].float().cpu()


class ScoringRoot(torch.nn.Module):
    """The FSDP2 root of a sharded reward model: `scores_of(model, rows)` in one forward, so the root's parameters
    (embeddings, final norm, score head) are unsharded while they are used."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, scores_of, rows: list[list[int]]) -> torch.Tensor:
        return scores_of(self.model, rows)


class FSDPRewardModelWorker(RewardModelWorker):
    """The reward model sharded over the ranks of a WorkerGroup like the reference (actor.strategy=fsdp2, the
    actor's actor.fsdp settings): each rank scores its share of the conversations (balanced by tokens), every rank
    running as many forward passes as the busiest (FSDP2's all-gathers pair up), and rank 0 returns all the scores
    (None elsewhere)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config: RewardModelConfig,
                 dtype: str, fsdp: FSDPConfig, device: str = "cpu", torch_threads: int = 0):
        set_threads(torch_threads)
        self.config, self.device, self.rank, self.world_size = config, device, rank, world_size
        mesh = init_distributed(rank, world_size, master_addr, master_port, device, fsdp.mesh_shape(world_size))
        self._load(config, dtype, "cpu")
        self.root = shard_policy(self.model, mesh, device, fsdp, DTYPES[dtype], root=ScoringRoot)

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str], messages: list[list[dict]] | None = None):
        ids = self.encode(prompts, responses, messages)
        lengths = [len(row) for row in ids]
        per_rank = [[[share[i] for i in group] for group in self._micro_batches([lengths[i] for i in share])]
                    for share in balanced_groups(lengths, self.world_size)]
        mine, parts = per_rank[self.rank], []
        for group in mine:
            parts.append((group, self._forward([ids[i] for i in group])))
        for _ in range(max(map(len, per_rank)) - len(mine)):   # a one-token forward pass per missing one
            self._forward([ids[0][:1]])
        self.root.reshard()   # the root stays unsharded after a forward that no backward follows
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, parts)
        release_cached_memory()
        if self.rank:
            return None
        scores = torch.zeros(len(ids))
        for group, values in (part for rank_parts in gathered for part in rank_parts):
            scores[group] = values
        return scores
