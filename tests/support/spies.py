"""Spies on the engine's parts, installed with pytest's monkeypatch for one test, and a reader of its streams."""

from specdec.drafters import HybridDrafter, ModelDrafter


def hybrid_rounds(monkeypatch) -> list[list[str]]:
    """The drafters of every hybrid round's proposals ("model" | "lookup" per token), recorded as proposed."""
    rounds, original = [], HybridDrafter.propose

    def spy(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        rounds.append(list(proposal.drafters))
        return proposal

    monkeypatch.setattr(HybridDrafter, "propose", spy)
    return rounds


def model_runs(monkeypatch) -> list[tuple[int, int]]:
    """(tokens proposed, the most it could propose: min(gamma, limit)) of every ModelDrafter.propose call."""
    runs, original = [], ModelDrafter.propose

    def spy(self, ids, gamma, limit, generator_at):
        proposal = original(self, ids, gamma, limit, generator_at)
        runs.append((len(proposal), min(gamma, limit)))
        return proposal

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    return runs


def ended_early(runs: list[tuple[int, int]]) -> int:
    """Runs the draft-confidence stop ended before their cap."""
    return sum(proposed < cap for proposed, cap in runs)


def model_draws(monkeypatch) -> list[bool]:
    """For every token the draft model drew as a drafter: may its run go on after it (the confidence stop)?"""
    draws, original = [], ModelDrafter.draw

    def spy(self, *args, **kwargs):
        drawn = original(self, *args, **kwargs)
        if drawn is not None:  # None: a grammar allowed none of the draft's tokens, nothing drawn
            draws.append(drawn[2])
        return drawn

    monkeypatch.setattr(ModelDrafter, "draw", spy)
    return draws


def fail_after_first_chunk(monkeypatch, decoder) -> None:
    """decoder.stream yields its first round's Chunk, then raises RuntimeError("boom"): a failure mid-stream."""
    real_stream = decoder.stream

    def failing(*args, **kwargs):
        stream = real_stream(*args, **kwargs)
        yield next(stream)
        raise RuntimeError("boom")

    monkeypatch.setattr(decoder, "stream", failing)


def rounds_of(stream) -> tuple[list, object]:
    """Every Chunk a SpeculativeDecoder.stream yields (one a round), and the GenerationResult it returns."""
    chunks = []
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as done:
            return chunks, done.value
