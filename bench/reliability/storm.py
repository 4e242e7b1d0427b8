"""Part storm: rounds of clients that each send a whole chat request and close at once, beside CPU-bound processes
(the load under which a full test run found a gone client uncounted: Hypercorn had told it first)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.reliability.common import HTTP_TIMEOUT_S, IDLE_WAIT_S, SERVED, PartResult, Setup

SENDERS = 4  # threads sending a round's clients
BURNER = "while True: pass"


def send_and_leave(address: tuple[str, int], request: bytes, clients: int) -> None:
    for _ in range(clients):
        with socket.create_connection(address) as connection:
            connection.sendall(request)


def storm_request(host: str, max_tokens: int) -> bytes:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Write a very long essay."}]}
    payload = json.dumps({**body, "max_tokens": max_tokens, "logit_bias": {"0": -100, "2": -100}}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def settle(health: httpx.Client, before: dict[str, Any], clients: int) -> tuple[dict[str, Any], float]:
    """/health once every client was told and every connection but the poll's own counted out, or at the bound."""
    started = time.monotonic()
    while True:
        after: dict[str, Any] = health.get("/health").json()
        told = after["connections"]["client_gone"] - before["connections"]["client_gone"]
        idle = (after["scheduler"]["running"], after["scheduler"]["waiting"]) == (0, 0)
        waited = time.monotonic() - started
        if (told == clients and idle and after["connections"]["open"] == 1) or waited > 2 * IDLE_WAIT_S:
            return after, waited
        time.sleep(0.05)


def run_storm(setup: Setup) -> PartResult:
    args = setup.args
    flags = ("--max-batch", "4", "--max-queue", "256", "--keep-alive-timeout", "600")
    result, courier = setup.part("storm", "bench.reliability --parts storm", flags)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.storm_burners)]
    rounds: list[dict[str, Any]] = []
    try:
        with courier as server, httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as health:
            address = httpx.URL(server.base_url)
            host, port = address.host, address.port
            assert port is not None
            request, share = storm_request(host, args.storm_max_tokens), args.storm_clients // SENDERS
            for _ in range(args.storm_rounds):
                before = health.get("/health").json()
                with ThreadPoolExecutor(SENDERS) as senders:
                    list(senders.map(lambda _: send_and_leave((host, port), request, share), range(SENDERS)))
                after, waited = settle(health, before, share * SENDERS)
                scheduler = {key: after["scheduler"][key] - before["scheduler"][key] for key in before["scheduler"]}
                told = after["connections"]["client_gone"] - before["connections"]["client_gone"]
                rounds.append({"clients": share * SENDERS, "told": told, "open_after": after["connections"]["open"],
                               "settled_s": round(waited, 2), "generated": scheduler["generated_tokens"],
                               "completed": scheduler["completed"]})  # fmt: skip
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    result.row("rounds x clients (max_tokens), CPU burners beside", f"{len(rounds)} x {args.storm_clients} "
               f"({args.storm_max_tokens}), {args.storm_burners}")  # fmt: skip
    result.row("told per round", " ".join(str(r["told"]) for r in rounds))
    result.row("connections open after each round", " ".join(str(r["open_after"]) for r in rounds))
    result.row("settled in (s), per round", " ".join(str(r["settled_s"]) for r in rounds))
    result.row("tokens generated, per round", " ".join(str(r["generated"]) for r in rounds))
    result.check("every gone client told", all(r["told"] == r["clients"] for r in rounds))
    result.check("every connection counted out (the poll's own left)", all(r["open_after"] == 1 for r in rounds))
    result.check("no gone client's reply completed", all(r["completed"] == 0 for r in rounds))
    result.check("at most a step's token each", all(r["generated"] <= r["clients"] for r in rounds))
    result.data = {"rounds": rounds}
    return result
