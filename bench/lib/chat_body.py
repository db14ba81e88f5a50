#!/usr/bin/env python3
"""Writes an OpenAI chat-completions request body of about SIZE bytes for bench/proxy_bench.sh.

    chat_body.py SIZE OUT [SYSTEM_BYTES]

The shape of an agent's long prompt: a system prompt of SYSTEM_BYTES (default 150000) bytes of
JSON text (instructions, a tool manual, code with quotes and newlines to escape), shared by
every body this script writes whatever SIZE, then user, assistant and tool turns (logs, file
contents) until the body reaches SIZE bytes, then a short last user question. The text is
generated from a fixed seed: equal arguments give equal bytes, and a body's system prompt is
byte for byte the one of any other size. Prints the message count and the sizes of the
system prompt and of the body.
"""
import json
import random
import sys

WORDS = (
    "the replica cache prefix token block route request latency queue decode prefill model "
    "agent tool call result file function return error retry budget context window memory "
    "server client stream event batch schedule worker thread socket buffer header body json "
    "config deploy rollout metric trace span log level warning debug info timeout deadline "
    "a an of to in on for with by from as at is are was be this that it its we you they"
).split()

CODE = [
    'def route(request, replicas):\n    best = max(replicas, key=lambda r: r.matched(request))\n'
    '    return best if best.queue < 32 else least_loaded(replicas)\n',
    'fn hash_block(parent: u64, tokens: &[u32]) -> u64 {\n    let mut h = parent;\n'
    '    for t in tokens { h = h.rotate_left(5) ^ u64::from(*t); }\n    h\n}\n',
    'if (status != 200) {\n    console.error("replica \\"%s\\" answered %d", url, status);\n'
    '    return retry(req, {backoff: "exponential", max: 3});\n}\n',
    '$ kubectl -n inference get pods -l app=vllm -o wide\n'
    'NAME          READY   STATUS    RESTARTS   AGE\nvllm-0        1/1     Running   0          3d\n',
]


def prose(rng, n):
    """About n bytes of sentences and paragraphs (newlines, quotes, now and then code)."""
    out, size = [], 0
    while size < n:
        if rng.random() < 0.08:
            piece = "\n```\n" + rng.choice(CODE) + "```\n"
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 24))]
            if rng.random() < 0.2:
                i = rng.randrange(len(words))
                words[i] = '"' + words[i] + '"'
            piece = " ".join(words).capitalize() + ("." if rng.random() < 0.85 else ":\n")
            if rng.random() < 0.1:
                piece += "\n\n"
            else:
                piece += " "
        out.append(piece)
        size += len(piece)
    return "".join(out)


def encoded(messages):
    return len(json.dumps(messages, separators=(",", ":")).encode())


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: chat_body.py SIZE OUT [SYSTEM_BYTES]")
    size = int(sys.argv[1])
    out = sys.argv[2]
    system_bytes = int(sys.argv[3]) if len(sys.argv) == 4 else 150000
    rng = random.Random(20261205)
    system = "You are a coding agent working in a large repository.\n\n" + prose(rng, system_bytes)
    head = {"model": "meta-llama/Llama-3.1-8B-Instruct"}
    tail = {"max_tokens": 256, "temperature": 0.2, "stream": False, "user": "bench-agent-0001"}
    messages = [{"role": "system", "content": system}]
    question = {"role": "user", "content": "Which of the files above holds the retry budget, "
                "and what would you change to stop the retries from piling up?"}
    fixed = encoded({**head, "messages": [], **tail}) + encoded([question]) + 1
    turn = 0
    while True:
        left = size - fixed - encoded(messages)
        if left < 400:
            break
        want = min(rng.randint(8000, 40000), left - 200)
        role = ("user", "assistant", "tool")[turn % 3]
        msg = {"role": role, "content": ""}
        if role == "tool":
            msg["tool_call_id"] = "call_%04d" % turn
        # Grow the text until the encoded message (escapes included) fills `want`.
        text = prose(rng, want)
        while encoded([msg | {"content": text}]) > want and len(text) > 64:
            text = text[: len(text) - max(16, (encoded([msg | {"content": text}]) - want))]
        msg["content"] = text
        messages.append(msg)
        turn += 1
    messages.append(question)
    body = json.dumps({**head, "messages": messages, **tail}, separators=(",", ":")).encode()
    with open(out, "wb") as f:
        f.write(body)
    print(
        "%d messages, system prompt %d bytes of JSON, body %d bytes"
        % (len(messages), len(json.dumps(system).encode()), len(body))
    )


if __name__ == "__main__":
    main()
