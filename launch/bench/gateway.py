"""`longhorizon bench gateway`: what the training gateway adds to a call, against calling the engine directly.

For each number of concurrent sessions (`--sessions 1,32`), every session plays the same short
chat (`--calls` turns: a topic, then "Go on." after each reply) twice:
- direct: the prompt tokens the gateway would render, straight to `engine.generate`;
- gateway: the same chat as OpenAI requests over HTTP (httpx, keep-alive) to a gateway serving
  that engine on loopback, each session posting its reward at the end.
Both sample greedily, so both paths generate the same tokens. The figure is the mean latency per
call and the gateway's overhead over direct, in percent (target: at most 10% on the hf engine).
The client runs in the gateway's process, as an agent on the same machine would share its cores.

Run: `longhorizon bench gateway --sessions 1,32 --calls 4 --new-tokens 16`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from longhorizon.common.args import positive_int
from longhorizon.launch.bench.tables import Column, parsed, print_table, run_as_command
from longhorizon.actor.engines.base import GenerationRequest, EngineSettings, make_engine
from longhorizon.actor.gateway import ChatRenderer, GatewaySettings, SessionBook
from longhorizon.actor.gateway_server import Gateway, serve_gateway
from longhorizon.common.config import SamplingConfig
from longhorizon.common.models import DEFAULT_MODEL, resolve_model_path
from longhorizon.envs.tool_calls import get_tool_call_format

PROG = "longhorizon bench gateway"
_TOPICS = ["the sea", "bread", "a lighthouse", "owls", "rain", "chess", "a market", "trains"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="model folder or name (default: the default model)")
    parser.add_argument("--sessions", default="1,32", help="comma-separated numbers of concurrent sessions")
    parser.add_argument("--calls", type=positive_int, default=4, help="calls per session")
    parser.add_argument("--new-tokens", type=positive_int, default=16, help="most tokens per reply")
    parser.add_argument("--max-batch-size", type=positive_int, default=32)
    return parser


def _messages(session: int) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {_TOPICS[session % len(_TOPICS)]}."}]


async def _direct(engine, renderer, sessions: int, calls: int) -> list[float]:
    import trio


    latencies: list[float] = []

    async def session(index: int) -> None:
        tokens = renderer.prompt_tokens(_messages(index), None)
        for turn in range(calls):
            started = time.perf_counter()
            generation = await engine.generate(GenerationRequest(token_ids=list(tokens), episode_id=f"d{index}"))
            latencies.append(time.perf_counter() - started)
            tokens = tokens + list(generation.token_ids) + renderer.continuation_tokens(
                [{"role": "user", "content": "Go on."}], generation.stopped_on_eos)
        engine.end_episode(f"d{index}")

    async with trio.open_nursery() as nursery:
        for index in range(sessions):
            nursery.start_soon(session, index)
    return latencies


async def _through_gateway(url: str, sessions: int, calls: int, tag: str) -> list[float]:
    import httpx
    import trio

    latencies: list[float] = []
    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def session(index: int) -> None:
            session_id = f"{tag}-{index}"
            messages = _messages(index)
            for turn in range(calls):
                started = time.perf_counter()
                response = await client.post("/chat/completions", json={"model": "m", "messages": messages},
                                             headers={"X-Session-Id": session_id, "X-Task-Id": f"t{index}"})
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()
                messages = [*messages, response.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            (await client.post(f"/sessions/{session_id}/reward", json={"reward": 0.0})).raise_for_status()

        async with trio.open_nursery() as nursery:
            for index in range(sessions):
                nursery.start_soon(session, index)
    return latencies


def run(argv: list[str]) -> dict[str, Any]:
    """Measure each concurrency both ways, print the table, return the figures."""
    args = parsed(build_parser(), argv)
    counts = [int(part) for part in args.sessions.split(",") if part.strip()]
    import trio


    model = resolve_model_path(args.model or DEFAULT_MODEL)
    engine = make_engine("hf", EngineSettings(
        model_path=str(model), sampling=SamplingConfig(temperature=0.0, max_new_tokens=args.new_tokens),
        max_batch_size=args.max_batch_size))
    renderer = ChatRenderer(engine.tokenizer, get_tool_call_format("hermes"))
    sent: list = []

    async def keep(trajectory) -> None:
        sent.append(trajectory)

    rows = []

    async def measure() -> None:
        book = SessionBook(GatewaySettings(group_size=max(counts), max_context_tokens=1 << 15,
                                           max_new_tokens=args.new_tokens), renderer)
        gateway = Gateway(engine, book, model_name="bench", horizon_cap=lambda: args.calls, on_trajectory=keep)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_gateway, gateway, "127.0.0.1", 0)
            await _direct(engine, renderer, 1, 1)  # warm-up: first-call costs belong to neither path
            for sessions in counts:
                direct = await _direct(engine, renderer, sessions, args.calls)
                through = await _through_gateway(f"{url}/v1", sessions, args.calls, f"s{sessions}")
                rows.append({
                    "sessions": sessions, "calls": len(direct),
                    "direct_ms": 1000 * statistics.mean(direct), "gateway_ms": 1000 * statistics.mean(through),
                    "overhead_percent": 100 * (statistics.mean(through) / statistics.mean(direct) - 1),
                })
            nursery.cancel_scope.cancel()

    trio.run(measure)
    print_table(
        [Column("sessions", 8), Column("calls", 6), Column("direct ms/call", 14, ".1f"),
         Column("gateway ms/call", 15, ".1f"), Column("overhead %", 10, "+.1f")],
        [(r["sessions"], r["calls"], r["direct_ms"], r["gateway_ms"], r["overhead_percent"]) for r in rows])
    return {"model": str(model), "new_tokens": args.new_tokens, "calls_per_session": args.calls,
            "trajectories": len(sent), "rows": rows}


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
