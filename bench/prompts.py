"""The benchmarks' prompt sets: the committed JSONL files, reading them, and encoding a prompt as the service does."""

import json
from pathlib import Path

from specdec.text import encode_prompt

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
GROUNDED_PROMPTS = Path(__file__).resolve().parent / "prompts_grounded.jsonl"
PROMPT_SETS = {"default": DEFAULT_PROMPTS, "grounded": GROUNDED_PROMPTS}
# structured outputs (bench/structured.py): each prompt has a JSON `schema`, or `tools` (a required tool call)
STRUCTURED_PROMPTS = Path(__file__).resolve().parent / "prompts_structured.jsonl"


def load_prompts(path, limit: int | None = None) -> list[dict]:
    """The prompt set: one JSON object per line with `id`, `category`, `prompt` and `chat`."""
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


def encode(tokenizer, item: dict) -> list[int]:
    return encode_prompt(tokenizer, item["prompt"], chat=bool(item.get("chat")) and bool(tokenizer.chat_template))
