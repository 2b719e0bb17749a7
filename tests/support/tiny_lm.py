"""A one-layer causal transformer that is cheap enough to sample 20,000 times per statistical test.

It speaks the interface the engine relies on (a config, input embeddings, `forward(input_ids, cache, ...)`,
`.logits`) and keeps its keys and values in a real transformers DynamicCache, so cache rollback is exercised
through `crop` exactly as with library models. Its next-token distribution depends on the whole prefix.
"""

import torch
from torch import nn
from transformers import LlamaConfig


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size: int = 8, hidden: int = 16, context: int = 64, seed: int = 0, scale: float = 1.0):
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=context,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(context, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab_size)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * scale)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep: int = 0):
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + input_ids.size(1))
        x = self.embed(input_ids) + self.position(positions)  # (1, T, H)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (1, 1, T, H) each
        if cache is not None:
            k, v = cache.update(k, v, 0)
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril(k.size(2) - q.size(2))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)
        logits = self.head(torch.tanh(x + attended))
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return _Output(logits)


class _Output:
    def __init__(self, logits):
        self.logits = logits
