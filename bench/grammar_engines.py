"""Measure the grammar libraries on the default pair's tokenizer: the tables' build time (once per process), the
compile time per schema, and the mask time per token along a valid document (its forced tokens included).

    python -m bench.grammar_engines [--tokenizer DIR] [--repeats N]

llguidance always; xgrammar too where it imports (it is not a dependency: its wheel pulls in triton, so measure
it from a separate folder with PYTHONPATH, e.g. `pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi`).
"""

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "pet": ({"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
             "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                            "kind": {"enum": ["cat", "dog", "bird"]}}},
            {"name": "Rex", "age": 3, "kind": "dog"}),
    "invoice": ({"type": "object", "additionalProperties": False, "required": ["id", "customer", "lines", "total"],
                 "properties": {"id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                                "customer": {"type": "object", "required": ["name", "email"],
                                             "properties": {"name": {"type": "string"},
                                                            "email": {"type": "string", "format": "email"}}},
                                "lines": {"type": "array", "items": {
                                    "type": "object", "required": ["item", "qty", "price"],
                                    "properties": {"item": {"type": "string"}, "qty": {"type": "integer"},
                                                   "price": {"type": "number"}}}},
                                "total": {"type": "number"}}},
                {"id": "INV-0042", "customer": {"name": "Ann Lee", "email": "ann@example.com"},
                 "lines": [{"item": "pen", "qty": 3, "price": 1.5}, {"item": "book", "qty": 1, "price": 12.0}],
                 "total": 16.5}),
}


def llguidance_rows(tokenizer, vocab, repeats):
    import llguidance

    from specdec.grammar import JSON_OPTIONS, GrammarState, ll_tokenizer

    start = time.perf_counter()
    ll = ll_tokenizer(tokenizer, vocab)
    rows = [("llguidance", "tokenizer tables", time.perf_counter() - start, None)]
    for name, (schema, document) in SCHEMAS.items():
        compiles = []
        for _ in range(repeats):
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS), log_level=0)
            compiles.append(time.perf_counter() - start)
        ids = tokenizer.encode(json.dumps(document, separators=(", ", ": ")), add_special_tokens=False)
        masks = []  # per repeat: the mean per token along the document
        for _ in range(repeats):
            state = GrammarState(matcher.deep_copy(), vocab, {tokenizer.eos_token_id})
            start = time.perf_counter()
            for token in ids:
                state.allowed()  # the mask as the engine uses it: a (V,) bool tensor
                state.forced()
                state.advance(token)
            masks.append((time.perf_counter() - start) / len(ids))
        rows.append(("llguidance", name, statistics.median(compiles), statistics.median(masks)))
    return rows


def xgrammar_rows(tokenizer, vocab, repeats):
    try:
        import xgrammar
    except ImportError as error:
        return [("xgrammar", f"not importable ({error})", None, None)]
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    rows = [("xgrammar", "tokenizer tables", time.perf_counter() - start, None)]
    for name, (schema, document) in SCHEMAS.items():
        compiles = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(", ", ": "))
            compiles.append(time.perf_counter() - start)
        ids = tokenizer.encode(json.dumps(document, separators=(", ", ": ")), add_special_tokens=False)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        shifts = torch.arange(32, dtype=torch.int32)
        masks = []
        for _ in range(repeats):
            matcher = xgrammar.GrammarMatcher(compiled)
            start = time.perf_counter()
            for token in ids:
                matcher.fill_next_token_bitmask(bitmask)
                ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab].bool()
                matcher.find_jump_forward_string()
                assert matcher.accept_token(token)
            masks.append((time.perf_counter() - start) / len(ids))
        rows.append(("xgrammar", name, statistics.median(compiles), statistics.median(masks)))
    return rows


def main(argv=None):
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default pair's target)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    folder = args.tokenizer or default_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = 151936 if "qwen" in folder.lower() else len(tokenizer)
    print(f"tokenizer {folder}: {len(tokenizer)} tokens, masks over {vocab}")
    print(f"{'library':<11} {'what':<18} {'compile ms':>11} {'mask+forced+step ms/token':>26}")
    for library, what, compile_s, mask_s in llguidance_rows(tokenizer, vocab, args.repeats) + \
            xgrammar_rows(tokenizer, vocab, args.repeats):
        compile_ms = "-" if compile_s is None else f"{compile_s * 1000:.2f}"
        mask_ms = "-" if mask_s is None else f"{mask_s * 1000:.3f}"
        print(f"{library:<11} {what:<18} {compile_ms:>11} {mask_ms:>26}")


def default_tokenizer_dir() -> str:
    import os
    return os.path.expanduser("~/.cache/specdec/qwen2.5-coder-1.5b-instruct")


if __name__ == "__main__":
    main()
