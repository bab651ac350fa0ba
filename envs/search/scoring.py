"""Answer scoring for the search env: SQuAD-style normalisation, exact match and token F1."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD rules)."""
    lowered = text.lower()
    without_punctuation = "".join(character for character in lowered if character not in _PUNCTUATION)
    without_articles = _ARTICLES.sub(" ", without_punctuation)
    return " ".join(without_articles.split())


def exact_match(prediction: str, golden_answers: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised golden answer, else 0.0."""
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(gold) for gold in golden_answers))


def _token_f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golden_answers: Iterable[str]) -> float:
    """The best token-level F1 between the normalised prediction and any golden answer."""
    prediction_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        if not prediction_tokens or not gold_tokens:
            # Two empty answers agree; an empty one against a non-empty one shares nothing.
            best = max(best, float(prediction_tokens == gold_tokens))
            continue
        best = max(best, _token_f1(prediction_tokens, gold_tokens))
    return best
