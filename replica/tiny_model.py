"""Build a tiny Llama model and LoRA adapters locally, for tests against a real vLLM engine.

No model hub is reachable here, so end-to-end tests make their own model: a byte-level BPE
tokenizer trained on deterministic text, and a randomly initialised 2-layer Llama saved in
bfloat16. It generates garbage, but vLLM's KV cache, prefix cache, KV events, LoRA and metrics on
it are all real. Head dim is 64 because vLLM's CPU attention kernels refuse smaller heads.

The builder needs ``torch``, ``transformers`` and ``safetensors``, which live only in the vLLM
venv (``.venv-vllm/``); run it with that interpreter::

    .venv-vllm/bin/python -m replica.tiny_model OUT_DIR --adapters 3

From the main venv, ``ensure_tiny_model`` runs that command for you and caches the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: Bump when the recipe changes, so cached builds are rebuilt rather than silently reused.
RECIPE_VERSION = 2

VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
NUM_HEADS = 2  # head_dim 64: the CPU attention kernels need head_dim >= 64
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

#: A minimal chat template: the tools a request offers (as vLLM hands them to templates, so the
#: e2e tier checks the gateway renders them the same), role-tagged turns, then the assistant tag
#: when a reply is wanted.
CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS_TEXT = (
    "the a fleet of replicas routes every request to the engine that already holds its prefix "
    "cache block token adapter tenant model gateway latency throughput queue prefill decode "
    "system prompt user assistant answer question document retrieval context window memory "
    "index hash chain epoch event stored removed cleared sequence number replay metrics health "
    "river mountain forest ocean city garden library music painting story morning evening"
)


@dataclass(frozen=True)
class TinyModel:
    """Paths of a built tiny model and its adapters."""

    model_dir: Path
    adapters: dict[str, Path]

    @property
    def tokenizer_file(self) -> Path:
        """The ``tokenizer.json`` that both vLLM and fleetgate's tokenizer read."""
        return self.model_dir / "tokenizer.json"


def _corpus(lines: int = 4000, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English training text (same seed, same tokenizer, same model)."""
    rng = random.Random(seed)
    words_pool = _WORDS_TEXT.split()
    out = []
    for _ in range(lines):
        words = [rng.choice(words_pool) for _ in range(rng.randint(5, 20))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> int:
    """Train a byte-level BPE on deterministic text and write the tokenizer files.

    Returns the vocabulary size actually produced. No BOS is added on encode (no post-processor,
    ``add_bos_token: false``) so that a plain ``tokenizers`` encode equals vLLM's tokenization.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2)
    )
    return int(tokenizer.get_vocab_size())


def build_tiny_model(out_dir: Path | str, seed: int = 0) -> Path:
    """Write a tiny random Llama (tokenizer + bf16 weights) to ``out_dir`` and return it.

    Must run under the vLLM venv (needs torch and transformers).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "fleetgate_recipe.json").write_text(json.dumps({"recipe": RECIPE_VERSION}))
    return out


def build_lora_adapter(
    out_dir: Path | str,
    base_dir: Path | str,
    name: str,
    rank: int = 8,
    seed: int = 0,
) -> Path:
    """Write a random LoRA adapter (PEFT layout) for the tiny model at ``base_dir``.

    Targets ``q_proj`` and ``v_proj`` of every layer; small random A and B so the adapter really
    changes the model's output (a zero B would make it a no-op, hiding LoRA routing bugs).
    """
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1 (got {rank})")
    base = Path(base_dir)
    config = json.loads((base / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = hidden // heads
    out_features = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, out_dim in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, hidden, generator=gen) * 0.02
            ).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_dim, rank, generator=gen) * 0.02
            ).contiguous()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(out_features),
        "base_model_name_or_path": str(base),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "name": name,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def adapter_name(index: int) -> str:
    """The conventional name of the ``index``-th test adapter: ``tiny-lora-0``, ``-1``, ..."""
    return f"tiny-lora-{index}"


def _built(root: Path, adapters: int) -> TinyModel | None:
    """The cached build under ``root`` if it is complete and of the current recipe."""
    model_dir = root / "model"
    marker = model_dir / "fleetgate_recipe.json"
    if not marker.exists() or json.loads(marker.read_text()).get("recipe") != RECIPE_VERSION:
        return None
    found = {adapter_name(i): root / "adapters" / adapter_name(i) for i in range(adapters)}
    if not all((p / "adapter_model.safetensors").exists() for p in found.values()):
        return None
    return TinyModel(model_dir=model_dir, adapters=found)


def build_all(root: Path | str, adapters: int = 3) -> TinyModel:
    """Build the model under ``root/model`` and adapters under ``root/adapters/<name>``."""
    base = Path(root)
    model_dir = build_tiny_model(base / "model")
    paths = {}
    for i in range(adapters):
        name = adapter_name(i)
        paths[name] = build_lora_adapter(base / "adapters" / name, model_dir, name, seed=100 + i)
    return TinyModel(model_dir=model_dir, adapters=paths)


def ensure_tiny_model(root: Path | str, adapters: int = 3, python: Path | None = None) -> TinyModel:
    """Build (or reuse a cached build of) the tiny model from any venv.

    Runs the builder under the vLLM venv's interpreter (``python``, default: the one that
    ``replica.vllm_env`` locates), because torch and transformers live only there.
    """
    from replica.vllm_env import REPO_ROOT, require_vllm_env

    base = Path(root)
    cached = _built(base, adapters)
    if cached is not None:
        return cached
    interpreter = python or require_vllm_env(check_import=False)
    # Build beside the target and rename into place, so a concurrent test session never sees
    # (or reuses) a half-written model.
    staging = base.with_name(f"{base.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    proc = subprocess.run(
        [str(interpreter), "-m", "replica.tiny_model", str(staging), "--adapters", str(adapters)],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"building the tiny model failed: {proc.stderr.strip()[-2000:]}")
    if _built(staging, adapters) is None:
        raise RuntimeError(f"tiny model builder exited 0 but {staging} is incomplete")
    shutil.rmtree(base, ignore_errors=True)  # an incomplete or outdated earlier build
    try:
        staging.rename(base)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another session won the race
    built = _built(base, adapters)
    if built is None:
        raise RuntimeError(f"tiny model at {base} is incomplete after building")
    return built


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m replica.tiny_model OUT_DIR --adapters N``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write model/ and adapters/")
    parser.add_argument("--adapters", type=int, default=3, help="number of LoRA adapters")
    args = parser.parse_args(argv)
    if args.adapters < 0:
        parser.error(f"--adapters must be >= 0 (got {args.adapters})")
    built = build_all(args.out_dir, args.adapters)
    print(json.dumps({"model": str(built.model_dir),
                      "adapters": {k: str(v) for k, v in built.adapters.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
