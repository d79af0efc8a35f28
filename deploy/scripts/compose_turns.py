"""Multi-turn conversations through a running gateway, for the container stage.

    python3 compose_turns.py --gateway http://127.0.0.1:8080 --api-key KEY --model NAME [--token-ids]

Standard library only: it runs on the host, outside kvplane's environment. Every turn must be
answered 200, the first one included (it is sent as soon as the stack reports healthy); every
later turn carries the whole history, and at least one of them must be routed `pull`.
Exit status 0 when both hold; the decisions are printed either way, with each turn's seconds.

The client waits `--timeout-s` for a turn: longer than the gateway's own deadlines (a P leg that
outlives its timeout is retried once without the handle), so that a turn the gateway recovers is
seen recovered, as `retry_no_handle`, and counted, rather than cut off while the retry runs.

Chat by default. With --token-ids the turns are /v1/completions of token ids, as the slow
end-to-end tests send them: each later prompt is the previous prompt, the ids the engine
answered (return_token_ids) and new ids, so it continues exactly the tokens D retained, whatever
the model's tokenizer would make of the text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from typing import Any

DECISION_HEADER = "x-kvplane-decision"


def user_message(conversation: int, turn: int) -> str:
    # Long enough that the history grows by more than the engines' recompute threshold per turn.
    words = " ".join(f"w{conversation}x{turn}x{i}" for i in range(160))
    return f"Conversation {conversation}, turn {turn}: summarise these words. {words}"


def user_ids(run: str, conversation: int, turn: int) -> list[int]:
    # As many tokens as a user message has words, from the range every tokenizer of at least 32k
    # ids has (above the special tokens), new on every run; the first turn starts with BOS (1).
    rnd = random.Random(f"{run}-{conversation}-{turn}")
    ids = [rnd.randrange(100, 31000) for _ in range(160)]
    return [1, *ids] if turn == 0 else ids


def send_turn(
    gateway: str,
    api_key: str,
    conversation_id: str,
    path: str,
    body: dict[str, object],
    timeout_s: float,
) -> tuple[int, str, dict[str, Any] | str]:
    request = urllib.request.Request(
        f"{gateway}{path}",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {api_key}",
            "Content-Type": "application/json",
            "X-Conversation-Id": conversation_id,
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            choice = json.loads(response.read())["choices"][0]
            return response.status, response.headers.get(DECISION_HEADER, ""), choice
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
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="token-id completions (each of exactly --max-tokens tokens) instead of chat",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long to wait for one turn (default 600: past the gateway's own retry)",
    )
    args = parser.parse_args()

    run = uuid.uuid4().hex[:8]  # fresh conversations on every run against the same stack
    decisions: Counter[str] = Counter()
    failures: list[str] = []
    for conversation in range(args.conversations):
        conversation_id = f"compose-stage-{run}-{conversation}"
        messages: list[dict[str, str]] = []
        prompt: list[int] = []
        for turn in range(args.turns):
            body: dict[str, object] = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0}
            if args.token_ids:
                prompt += user_ids(run, conversation, turn)
                path = "/v1/completions"
                body.update(prompt=prompt, return_token_ids=True, ignore_eos=True)
            else:
                messages.append({"role": "user", "content": user_message(conversation, turn)})
                path = "/v1/chat/completions"
                body.update(messages=messages)
            start = time.monotonic()
            status, decision, reply = send_turn(
                args.gateway, args.api_key, conversation_id, path, body, args.timeout_s
            )
            size = f", {len(prompt)} prompt tokens" if args.token_ids else ""
            print(
                f"conversation {conversation} turn {turn}: HTTP {status}, decision {decision or '-'}{size},"
                f" {time.monotonic() - start:.1f} s",
                flush=True,
            )
            if isinstance(reply, str):
                failures.append(f"{conversation_id} turn {turn}: HTTP {status}: {reply[:300]}")
                break
            if turn > 0:
                decisions[decision] += 1
            if args.token_ids:
                prompt += [int(t) for t in reply["token_ids"]]
            else:
                messages.append({"role": "assistant", "content": str(reply["message"]["content"])})
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
