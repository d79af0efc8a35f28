"""Multi-turn conversations through a running gateway, for the container stage.

    python3 compose_turns.py --gateway http://127.0.0.1:8080 --api-key KEY --model NAME

Standard library only: it runs on the host, outside kvplane's environment. Every turn must be
answered 200, the first one included (it is sent as soon as the stack reports healthy); every
later turn carries the whole history, and at least one of them must be routed `pull`.
Exit status 0 when both hold; the decisions are printed either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid
from collections import Counter

DECISION_HEADER = "x-kvplane-decision"


def user_message(conversation: int, turn: int) -> str:
    # Long enough that the history grows by more than the engines' recompute threshold per turn.
    words = " ".join(f"w{conversation}x{turn}x{i}" for i in range(160))
    return f"Conversation {conversation}, turn {turn}: summarise these words. {words}"


def send_turn(
    gateway: str,
    api_key: str,
    model: str,
    conversation_id: str,
    messages: list[dict[str, str]],
    max_tokens: int,
) -> tuple[int, str, str]:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        f"{gateway}/v1/chat/completions",
        data=body.encode(),
        headers={
            "Authorization": f"Bearer {api_key}",
            "Content-Type": "application/json",
            "X-Conversation-Id": conversation_id,
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            payload = json.loads(response.read())
            reply = str(payload["choices"][0]["message"]["content"])
            return response.status, response.headers.get(DECISION_HEADER, ""), reply
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get(DECISION_HEADER, ""), error.read().decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="the gateway's base URL")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    # P's own prefix cache already holds each earlier prompt; what it pulls from D is the
    # answer D generated after it, so answers must be longer than the engines' recompute
    # threshold (64 tokens) for a pull to move anything.
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    run = uuid.uuid4().hex[:8]  # fresh conversations on every run against the same stack
    decisions: Counter[str] = Counter()
    failures: list[str] = []
    for conversation in range(args.conversations):
        conversation_id = f"compose-stage-{run}-{conversation}"
        messages: list[dict[str, str]] = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": user_message(conversation, turn)})
            status, decision, reply = send_turn(
                args.gateway, args.api_key, args.model, conversation_id, messages, args.max_tokens
            )
            print(f"conversation {conversation} turn {turn}: HTTP {status}, decision {decision or '-'}")
            if status != 200:
                failures.append(f"{conversation_id} turn {turn}: HTTP {status}: {reply[:300]}")
                break
            if turn > 0:
                decisions[decision] += 1
            messages.append({"role": "assistant", "content": reply})
    print("later turns by decision:", dict(decisions))
    if failures:
        print("failed turns:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    if decisions["pull"] == 0:
        print("no later turn was routed `pull`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
