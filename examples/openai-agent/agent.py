"""A black-box agent: plays an env served over HTTP with an OpenAI chat model, one session per episode.

It knows nothing of longhorizon: it speaks the OpenAI API (the official `openai` client) to a
model endpoint and AgentGym's HTTP API (`/tasks`, `/create`, `/step`, `/close`) to an env. Point
the model endpoint at a longhorizon training gateway and every episode it plays becomes a
trajectory for the learner; the only gateway-specific parts are the two headers that name the
session and its task, and the reward it posts when an episode ends.

    python examples/openai-agent/agent.py --env-url http://127.0.0.1:8300 \\
        --gateway-dir runs/textcraft-gateway/gateway --tools textcraft --group-size 8

Without `--gateway-dir` it plays against any OpenAI-compatible `--base-url` (no reward is posted).
With `--tools textcraft` the model acts through three function tools (get, craft, inventory) that
this script turns into TextCraft's commands; without, the reply's text is the action.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import threading
import time
import uuid

import httpx
import openai

TEXTCRAFT_TOOLS = [
    {"type": "function", "function": {
        "name": "get", "description": "Take some of a base item (an item no listed recipe makes).",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}, "count": {"type": "integer"}},
                       "required": ["item", "count"]}}},
    {"type": "function", "function": {
        "name": "craft", "description": "Craft an item with the ingredients of a listed crafting command.",
        "parameters": {"type": "object", "properties": {
            "item": {"type": "string"}, "count": {"type": "integer"},
            "ingredients": {"type": "array", "items": {"type": "object", "properties": {
                "item": {"type": "string"}, "count": {"type": "integer"}}, "required": ["item", "count"]}}},
            "required": ["item", "count", "ingredients"]}}},
    {"type": "function", "function": {
        "name": "inventory", "description": "Show what you carry.", "parameters": {"type": "object", "properties": {}}}},
]
TEXTCRAFT_SYSTEM = ("You craft items in a Minecraft-like world. Use the tools to take base items, craft with the "
                    "exact ingredients of a listed command, and look at your inventory. Call one tool per turn.")


def textcraft_command(name: str, arguments: dict) -> str:
    """TextCraft's text command for one of the tools above."""
    if name == "get":
        return f"get {arguments.get('count', 1)} {arguments.get('item', '')}"
    if name == "craft":
        parts = ", ".join(f"{part.get('count', 1)} {part.get('item', '')}" for part in arguments.get("ingredients", []))
        return f"craft {arguments.get('count', 1)} {arguments.get('item', '')} using {parts}"
    return "inventory"


class GatewayGone(Exception):
    """The model endpoint stopped answering: training has ended."""


def gateway_urls(folder: str, wait_s: float) -> dict[str, str]:
    """The gateways' addresses, from the files each actor writes when it starts serving (and
    deletes when it stops): {url: its file}."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        urls = {json.load(open(path))["url"]: path for path in sorted(glob.glob(f"{folder}/actor-*.json"))}
        if urls:
            return urls
        time.sleep(0.5)
    raise SystemExit(f"no gateway address appeared in {folder} within {wait_s:.0f}s")


def chat(client: openai.OpenAI, session: str, task: str, messages: list[dict], tools: list[dict] | None,
         ended=lambda: False):
    """One model call; None when the gateway refuses it (the episode is over: horizon or context).
    A connection that fails is tried again for a while (a server may close an idle keep-alive
    connection as the client reuses it); one that keeps failing, or `ended()` (the gateway's
    address file is gone), means training has ended."""
    unreachable_since = None
    for attempt in range(600):
        try:
            return client.chat.completions.create(
                model="policy", messages=messages, tools=tools or openai.NOT_GIVEN,
                extra_headers={"X-Session-Id": session, "X-Task-Id": task})
        except openai.BadRequestError as error:
            code = (error.body or {}).get("code") if isinstance(error.body, dict) else None
            if code in ("horizon_cap_reached", "context_length_exceeded"):
                return None
            raise
        except openai.InternalServerError as error:  # 503 before the learner's first horizon
            if error.status_code != 503:
                raise
            time.sleep(0.5)
        except openai.APIConnectionError as error:
            if ended():
                raise GatewayGone("the gateway has stopped (its address file is gone)") from None
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > 10:
                raise GatewayGone(f"no answer for 10 s ({error})") from None
            time.sleep(0.5)
    raise GatewayGone()


def play_episode(client, env: httpx.Client, rewards: httpx.Client | None, base_url: str, task: dict,
                 tools: list[dict] | None, system: str, ended=lambda: False) -> float:
    """One episode of `task`, as one gateway session; returns its reward."""
    session = uuid.uuid4().hex
    created = env.post("/create", json={"data_idx": task["data_idx"]}).raise_for_status().json()
    instance, observation, total, success, truncated = created["id"], created["observation"], 0.0, False, True
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]
    try:
        while True:
            reply = chat(client, session, task["task_id"], messages, tools, ended)
            if reply is None:
                break
            message = reply.choices[0].message
            calls = message.tool_calls or []
            if tools and len(calls) != 1:
                feedback = {"role": "user", "content": "Call exactly one tool."}
                messages += [message.model_dump(exclude_none=True), feedback]
                continue
            action = (textcraft_command(calls[0].function.name, json.loads(calls[0].function.arguments or "{}"))
                      if tools else (message.content or "").strip())
            step = env.post("/step", json={"id": instance, "action": action}).raise_for_status().json()
            total += float(step["reward"])
            success = bool(step.get("info", {}).get("success", success))
            if step["done"]:
                truncated = bool(step.get("truncated")) and not bool(step.get("terminated"))
                break
            messages.append(message.model_dump(exclude_none=True))
            if tools:
                messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": step["observation"]})
            else:
                messages.append({"role": "user", "content": step["observation"]})
    finally:
        env.post("/close", json={"id": instance})
    if rewards is not None:
        post_reward(rewards, f"{base_url}/sessions/{session}/reward",
                    {"reward": total, "success": success, "truncated": truncated}, ended)
    return total


def post_reward(rewards: httpx.Client, url: str, body: dict, ended=lambda: False) -> None:
    """Post an episode's reward, trying a failed connection again for a while; a 409 says an
    earlier try arrived (the session has ended)."""
    unreachable_since = None
    while True:
        try:
            response = rewards.post(url, json=body)
        except httpx.TransportError as error:
            if ended():
                raise GatewayGone("the gateway has stopped (its address file is gone)") from None
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > 10:
                raise GatewayGone(f"no answer for 10 s ({error!r})") from None
            time.sleep(0.5)
            continue
        if response.status_code != 409:
            response.raise_for_status()
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env-url", required=True, help="an env served by `longhorizon env serve`")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--gateway-dir", help="a training run's gateway folder (<run_dir>/gateway)")
    target.add_argument("--base-url", help="any OpenAI-compatible endpoint (no rewards posted)")
    parser.add_argument("--tools", choices=["none", "textcraft"], default="none")
    parser.add_argument("--group-size", type=int, default=8, help="episodes of a task played at once (a GRPO group)")
    parser.add_argument("--threads", type=int, default=8, help="groups played at once")
    parser.add_argument("--episodes", type=int, default=0, help="stop after this many (0: until the gateway ends)")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the gateway to appear")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    address_files = gateway_urls(args.gateway_dir, args.wait) if args.gateway_dir else {}
    urls = list(address_files) or [args.base_url]
    tools = TEXTCRAFT_TOOLS if args.tools == "textcraft" else None
    with httpx.Client(base_url=args.env_url, timeout=60) as setup:
        info = setup.get("/info").raise_for_status().json()
        tasks: list[dict] = []
        while True:  # the service hands tasks out a page at a time
            page = setup.get("/tasks", params={"split": "train", "offset": len(tasks), "limit": 500})
            page = page.raise_for_status().json()
            tasks += page["tasks"]
            if not page["tasks"] or len(tasks) >= page["total"]:
                break
    system = TEXTCRAFT_SYSTEM if tools else info.get("instructions", "")
    played, lock, stop = [0], threading.Lock(), threading.Event()
    rng = random.Random(args.seed)

    # One client per endpoint, shared by every thread (both are thread-safe and keep connections).
    pool = httpx.Limits(max_connections=args.threads * args.group_size + 8)
    clients = {url: openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=600,
                                  http_client=httpx.Client(limits=pool, timeout=600)) for url in urls}
    env = httpx.Client(base_url=args.env_url, timeout=60, limits=pool)
    rewards = httpx.Client(timeout=30, limits=pool) if args.gateway_dir else None

    def member(base_url: str, task: dict) -> None:
        try:
            address_file = address_files.get(base_url)
            ended = (lambda: not os.path.exists(address_file)) if address_file else (lambda: False)
            play_episode(clients[base_url], env, rewards, base_url, task, tools, system, ended)
        except GatewayGone as gone:
            if not stop.is_set():
                print(f"the gateway stopped answering: {gone}", file=sys.stderr, flush=True)
            stop.set()
            return
        with lock:
            played[0] += 1
            if args.episodes and played[0] >= args.episodes:
                stop.set()

    def worker(index: int) -> None:
        """Groups, one after another: the episodes of a group at once, as GRPO compares them."""
        base_url = urls[index % len(urls)]
        while not stop.is_set():
            with lock:
                task = rng.choice(tasks)
            members = [threading.Thread(target=member, args=(base_url, task)) for _ in range(args.group_size)]
            for thread in members:
                thread.start()
            for thread in members:
                thread.join()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"episodes": played[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
