"""The base model (a hub model, or a small Llama pre-trained here and cached), LoRA, training, loss.

Offline the base model is a Llama built from a ``LlamaConfig`` (a few layers, tiny hidden size,
byte-level tokens) and pre-trained briefly on the pre-training topics. Pre-training is the
expensive part, so its weights are cached on disk under a key of every setting that shapes them:
each seed and codec of a sweep fine-tunes the same base. Random draws run under
``torch.random.fork_rng`` with an explicit seed, so nothing here moves the caller's global RNG.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from flowertune_lora.dataset import ByteTokenizer, pretraining_text, windows


@dataclass(frozen=True)
class BaseSettings:
    """What defines the base model: a hub name, or the tiny Llama's shape and pre-training."""

    model_name: str = ""  # "" = the tiny Llama built here
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    seq_len: int = 128
    pretrain_steps: int = 300
    pretrain_batch: int = 16
    pretrain_lr: float = 3e-3
    base_seed: int = 0

    @classmethod
    def from_run_config(cls, config) -> BaseSettings:
        return cls(
            model_name=str(config["model-name"]),
            hidden=int(config["tiny-hidden"]),
            layers=int(config["tiny-layers"]),
            heads=int(config["tiny-heads"]),
            seq_len=int(config["seq-len"]),
            pretrain_steps=int(config["pretrain-steps"]),
            pretrain_batch=int(config["pretrain-batch-size"]),
            pretrain_lr=float(config["pretrain-learning-rate"]),
            base_seed=int(config["base-seed"]),
        )

    def cache_key(self) -> str:
        """A hash of these settings and of the pre-training text (a new split means a new base)."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        for text in pretraining_text():
            digest.update(text.encode())
        return digest.hexdigest()[:16]


def tokenizer_for(settings: BaseSettings):
    """The byte tokenizer offline; the hub model's own tokenizer otherwise."""
    if not settings.model_name:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(settings.model_name)


def encoder_for(settings: BaseSettings):
    """``text -> token ids`` for ``settings``' tokenizer."""
    tokenizer = tokenizer_for(settings)
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode
    return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]


def _tiny_llama(settings: BaseSettings):
    from transformers import LlamaConfig, LlamaForCausalLM

    if settings.hidden % settings.heads:
        raise ValueError(f"tiny-hidden {settings.hidden} is not a multiple of tiny-heads {settings.heads}")
    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=settings.hidden,
        intermediate_size=settings.hidden * 8 // 3,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.heads,
        max_position_embeddings=settings.seq_len + 1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _pretrain(model, settings: BaseSettings) -> None:
    data = windows(pretraining_text(), ByteTokenizer().encode, settings.seq_len)
    generator = torch.Generator().manual_seed(settings.base_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.pretrain_lr, weight_decay=0.01)
    model.train()
    for step in range(settings.pretrain_steps):
        for group in optimizer.param_groups:  # cosine decay: a short run still ends at a low rate
            group["lr"] = settings.pretrain_lr * 0.5 * (1 + math.cos(math.pi * step / settings.pretrain_steps))
        batch = data[torch.randint(len(data), (settings.pretrain_batch,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLOWERTUNE_LORA_CACHE", Path.home() / ".cache" / "flowertune-lora"))


def base_model(settings: BaseSettings, cache_dir: Path | None = None):
    """The base causal LM: downloaded from the hub by name, or the tiny Llama (pre-trained once, then cached)."""
    if settings.model_name:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(settings.model_name).float()  # float32 adapters and updates
    from transformers import LlamaForCausalLM

    folder = (cache_dir or default_cache_dir()) / f"tiny-llama-{settings.cache_key()}"
    if (folder / "config.json").exists():
        return LlamaForCausalLM.from_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.base_seed)
        model = _tiny_llama(settings)
        _pretrain(model, settings)
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    model.save_pretrained(staging)
    (staging / "base-settings.json").write_text(json.dumps(asdict(settings), indent=1))
    try:
        staging.rename(folder)  # atomic: a concurrent process sees a whole folder or none
    except OSError:  # another process cached the same settings first
        pass
    return LlamaForCausalLM.from_pretrained(folder)


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @classmethod
    def from_run_config(cls, config) -> LoraSettings:
        targets = tuple(t.strip() for t in str(config["lora-targets"]).split(",") if t.strip())
        return cls(r=int(config["lora-r"]), alpha=int(config["lora-alpha"]), targets=targets)


def lora_model(base, lora: LoraSettings, seed: int):
    """``base`` with fresh LoRA adapters (A drawn from ``seed``, B zero), the base frozen."""
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0,
                        task_type="CAUSAL_LM")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(base, config)


def train_steps(model, data: torch.Tensor, steps: int, batch_size: int, lr: float, generator: torch.Generator) -> float:
    """``steps`` AdamW steps on random windows of ``data``; the mean training loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    total = 0.0
    for _ in range(steps):
        batch = data[torch.randint(len(data), (batch_size,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        total += loss.item()
    model.eval()
    return total / steps


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats per token) over every window of ``data``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(data), batch_size):
        batch = data[start : start + batch_size]
        loss = model(input_ids=batch, labels=batch).loss
        total += float(loss) * len(batch)
        count += len(batch)
    return total / count
