"""Scoring of web tasks in WebArena's task-config format: string_match, url_match, program_html, state_check.

Pure functions: the env gathers what they need (the agent's answer, the final URL, the text each
program_html target selects, the sites' state-check verdicts) and these decide the score. The rules
follow WebArena's evaluation harness: every listed eval type must pass for a score of 1. WebArena
scores "fuzzy_match" with an LLM judge; we have none, so a reference passes when its normalised
text is contained in the normalised answer.
"""

from __future__ import annotations

import html
import re
import string
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

EVAL_TYPES = ("string_match", "url_match", "program_html", "state_check")
OR_SEPARATOR = " |OR| "

_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|\w+|[^\w\s]")
_PUNCTUATION = str.maketrans({character: " " for character in string.punctuation})


@dataclass
class EvalResult:
    score: float
    details: list[str] = field(default_factory=list)
    """One line per check, for people reading episode logs."""

    @property
    def success(self) -> bool:
        return self.score >= 1.0


def clean_answer(answer: str) -> str:
    """WebArena's answer cleaning: strip, drop one pair of surrounding quotes, lower-case."""
    answer = str(answer).strip()
    if len(answer) >= 2 and answer[0] == answer[-1] and answer[0] in "'\"":
        answer = answer[1:-1]
    return answer.lower()


def exact_match(reference: str, prediction: str) -> bool:
    return clean_answer(prediction) == clean_answer(reference)


def must_include(reference: str, prediction: str, *, tokenize: bool = False) -> bool:
    """The reference is a substring of the prediction; with `tokenize` (as WebArena does it) a
    one-character reference must be a whole token of the prediction (so "1" is not found in "10"
    or in "1,000")."""
    clean_reference, clean_prediction = clean_answer(reference), clean_answer(prediction)
    if tokenize and len(clean_reference) == 1:
        return clean_reference in _TOKEN.findall(clean_prediction)
    return clean_reference in clean_prediction


def normalize_text(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed: for the judge-free fuzzy match."""
    return " ".join(str(text).lower().translate(_PUNCTUATION).split())


def fuzzy_match(reference: str, prediction: str) -> bool:
    normalized_reference = normalize_text(reference)
    return bool(normalized_reference) and f" {normalized_reference} " in f" {normalize_text(prediction)} "


def string_match(reference_answers: Mapping[str, Any], answer: str) -> tuple[bool, str]:
    """Every approach listed in reference_answers must pass."""
    if not isinstance(reference_answers, Mapping) or not reference_answers:
        return False, "string_match: the task has no reference_answers"
    for approach, value in reference_answers.items():
        if approach == "exact_match":
            if not exact_match(str(value), answer):
                return False, f"string_match: {answer!r} is not exactly {value!r}"
        elif approach == "must_include":
            values = value if isinstance(value, list) else [value]
            for reference in values:
                # WebArena matches whole tokens when there is a single short reference.
                if not must_include(str(reference), answer, tokenize=len(values) == 1):
                    return False, f"string_match: {answer!r} does not include {reference!r}"
        elif approach == "fuzzy_match":
            if value == "N/A":
                # An unachievable task: the answer must say so (WebArena's judge also accepts a
                # reason; without a judge only "N/A" itself passes).
                if not exact_match("N/A", answer):
                    return False, f"string_match: {answer!r} is not 'N/A'"
            else:
                for reference in value if isinstance(value, list) else [value]:
                    if not fuzzy_match(str(reference), answer):
                        return False, f"string_match: {answer!r} does not contain {reference!r} (normalised)"
        else:
            return False, f"string_match: unknown approach {approach!r} (known: exact_match, must_include, fuzzy_match)"
    return True, "string_match: passed"


def _base_and_query(url: str) -> tuple[str, dict[str, list[str]]]:
    parts = urlsplit(url)
    return parts.netloc + parts.path, parse_qs(parts.query)


def url_match(reference_url: str, final_url: str, url_note: str = "GOLD in PRED") -> tuple[bool, str]:
    """WebArena's "GOLD in PRED": some reference's host+path is contained in the final URL's, and for
    every query key of the references the final URL carries one of their values. " |OR| " separates
    alternative references."""
    if (url_note or "GOLD in PRED") != "GOLD in PRED":
        return False, f"url_match: unknown url_note {url_note!r} (only 'GOLD in PRED' exists)"
    references = [url.strip().rstrip("/") for url in str(reference_url).split(OR_SEPARATOR) if url.strip()]
    if not references:
        return False, "url_match: the task has no reference_url"
    prediction_base, prediction_query = _base_and_query(final_url.strip().rstrip("/"))
    reference_queries: dict[str, set[str]] = defaultdict(set)
    base_found = False
    for reference in references:
        base, query = _base_and_query(reference)
        base_found = base_found or base in prediction_base
        for key, values in query.items():
            reference_queries[key].update(values)
    if not base_found:
        return False, f"url_match: {final_url!r} does not match {reference_url!r}"
    for key, values in reference_queries.items():
        if not any(value in prediction_query.get(key, []) for value in values):
            return False, f"url_match: query {key}={sorted(values)} missing from {final_url!r}"
    return True, "url_match: passed"


def required_contents_match(required: Mapping[str, Any], content: str) -> tuple[bool, str]:
    """A program_html target's required_contents against the text its locator selected."""
    content = html.unescape(content)
    if "exact_match" in required:
        expected = str(required["exact_match"])
        return exact_match(expected, content), f"exactly {expected!r}"
    if "must_include" in required:
        values = required["must_include"]
        for value in values if isinstance(values, list) else [values]:
            alternatives = str(value).split(OR_SEPARATOR)
            if not any(must_include(alternative, content) for alternative in alternatives):
                return False, f"includes {value!r}"
        return True, "includes every required content"
    return False, f"unknown required_contents {sorted(required)} (known: exact_match, must_include)"


def unsupported_features(eval_config: Mapping[str, Any]) -> list[str]:
    """What of a task's eval we cannot score (WebArena's Python helper locators, unknown types)."""
    problems = []
    for eval_type in eval_config.get("eval_types") or ():
        if eval_type not in EVAL_TYPES:
            problems.append(f"eval type {eval_type!r}")
    for target in eval_config.get("program_html") or ():
        for key in ("url", "locator"):
            value = str(target.get(key, ""))
            if value.startswith("func:"):
                problems.append(f"program_html {key} {value!r} (a WebArena helper function)")
        locator = str(target.get("locator", "")).strip()
        if locator and not locator.startswith(("document.", "[...document.", "func:")):
            problems.append(f"program_html locator {locator!r}")
    return problems


def evaluate(
    eval_config: Mapping[str, Any],
    *,
    answer: str,
    final_url: str,
    page_contents: Sequence[str | None] = (),
    state_results: Sequence[tuple[bool, str]] = (),
) -> EvalResult:
    """Score 1.0 when every eval type listed passes, else 0.0.

    page_contents[i] is the text program_html target i selected (None when it could not be read);
    state_results are the sites' verdicts on the state_check list, in order.
    """
    eval_types = list(eval_config.get("eval_types") or ())
    if not eval_types:
        return EvalResult(0.0, ["the task lists no eval_types"])
    details: list[str] = []
    passed = True
    for eval_type in eval_types:
        if eval_type == "string_match":
            ok, detail = string_match(eval_config.get("reference_answers") or {}, answer)
        elif eval_type == "url_match":
            ok, detail = url_match(eval_config.get("reference_url") or "", final_url, eval_config.get("url_note") or "GOLD in PRED")
        elif eval_type == "program_html":
            targets = list(eval_config.get("program_html") or ())
            ok, detail = bool(targets), "program_html: passed" if targets else "program_html: no targets"
            for index, target in enumerate(targets):
                content = page_contents[index] if index < len(page_contents) else None
                if content is None:
                    ok, detail = False, f"program_html target {index}: its page or locator could not be read"
                    break
                target_ok, description = required_contents_match(target.get("required_contents") or {}, content)
                if not target_ok:
                    ok, detail = False, f"program_html target {index}: content does not match ({description})"
                    break
        elif eval_type == "state_check":
            checks = list(eval_config.get("state_check") or ())
            ok, detail = bool(checks), "state_check: passed" if checks else "state_check: no checks"
            if len(state_results) < len(checks):
                ok, detail = False, "state_check: not every check was run"
            for index, (check_ok, reason) in enumerate(state_results):
                if not check_ok:
                    ok, detail = False, f"state_check {index}: {reason}"
                    break
        else:
            ok, detail = False, f"unknown eval type {eval_type!r} (known: {', '.join(EVAL_TYPES)})"
        details.append(detail)
        passed = passed and ok
    return EvalResult(1.0 if passed else 0.0, details)
