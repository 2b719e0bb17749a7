"""Spies on the engine's parts, installed with pytest's monkeypatch for one test."""

from specdec.drafters import HybridDrafter


def hybrid_rounds(monkeypatch) -> list[list[str]]:
    """The drafters of every hybrid round's proposals ("model" | "lookup" per token), recorded as proposed."""
    rounds, original = [], HybridDrafter.propose

    def spy(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        rounds.append(list(proposal.drafters))
        return proposal

    monkeypatch.setattr(HybridDrafter, "propose", spy)
    return rounds
