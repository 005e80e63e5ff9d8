"""The one client both servers are timed with: OpenAI-style /v1/completions with token-id
prompts, greedy (temperature 0), ignore_eos so every request generates exactly the tokens
asked for (checked against the response's usage). Prompts are random token ids from a fixed
seed, the same for both engines, and a different prompt for every request, so no server can
answer a repetition from a prompt cache.

    python3 client.py --url http://127.0.0.1:8080 --label moe-node --out result.json

Measures
  decode:   1 stream, short prompt, DECODE_TOKENS tokens, streamed; tokens/s over the time
            from the first to the last streamed token ((n-1) / (t_last - t_first)); 5 times
  prefill:  a PREFILL_TOKENS-token prompt, max_tokens 1, not streamed: prompt tokens / time
            to the response; 5 times
  batch:    CONCURRENT streams at once, BATCH_TOKENS tokens each: generated tokens / wall time;
            3 times
Each figure is reported as the median and the best of its repetitions: on a shared machine
the best is the closest to what the engine does undisturbed.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

DECODE_TOKENS = 128
DECODE_PROMPT = 16
PREFILL_TOKENS = 512
CONCURRENT = 8
BATCH_TOKENS = 64
BATCH_PROMPT = 16
REPS = 5
BATCH_REPS = 3
# Token ids drawn for prompts: clear of the low ids (byte tokens, the end-of-text token).
LOW, HIGH = 300, 31000


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


class Client:
    def __init__(self, url):
        u = urlparse(url)
        self.host, self.port = u.hostname, u.port

    def body(self, ids, max_tokens, stream):
        b = {
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b

    def post(self, ids, max_tokens):
        """Not streamed: (seconds, response json)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        data = json.dumps(self.body(ids, max_tokens, False))
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        t1 = time.perf_counter()
        conn.close()
        if resp.status != 200:
            sys.exit(f"HTTP {resp.status}: {raw[:500]!r}")
        return t1 - t0, json.loads(raw)

    def stream(self, ids, max_tokens):
        """Streamed: dict with ttft, t_first, t_last (seconds from the request), text,
        chunks (events carrying a token), usage (from the last event, when sent)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        data = json.dumps(self.body(ids, max_tokens, True))
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            sys.exit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        t_first = t_last = None
        chunks, text, usage = 0, [], None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter() - t0
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            # A token's event: it carries text, or is not the closing one (a token whose bytes
            # are an incomplete UTF-8 character may come with no text). The closing event
            # (finish_reason set, no text) is not a token's.
            if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                chunks += 1
                text.append(choices[0].get("text") or "")
                if t_first is None:
                    t_first = now
                t_last = now
        conn.close()
        return {"t_first": t_first, "t_last": t_last, "text": "".join(text),
                "chunks": chunks, "usage": usage}


def completion_tokens(usage, fallback=None):
    if usage and "completion_tokens" in usage:
        return usage["completion_tokens"]
    return fallback


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    c = Client(args.url)
    log = lambda *a: print(f"[{args.label}]", *a, flush=True)

    # Warm-up: one short request (pages the weights in, builds whatever is built lazily).
    secs, r = c.post(prompt(1, 8), 8)
    log(f"warm-up: {secs:.2f} s, usage {r.get('usage')}")

    # (a) Decode at batch 1.
    decode = []
    texts = []
    for rep in range(REPS):
        s = c.stream(prompt(100 + rep, DECODE_PROMPT), DECODE_TOKENS)
        n = completion_tokens(s["usage"], s["chunks"])
        if n != DECODE_TOKENS:
            sys.exit(f"[{args.label}] decode generated {n} tokens, not {DECODE_TOKENS} "
                     f"(usage {s['usage']}, {s['chunks']} chunks)")
        tps = (n - 1) / (s["t_last"] - s["t_first"])
        log(f"decode rep {rep}: {n} tokens ({s['chunks']} chunks), first token "
            f"{s['t_first']*1000:.0f} ms, last {s['t_last']*1000:.0f} ms -> {tps:.2f} tok/s")
        decode.append(tps)
        texts.append(s["text"])

    # (b) Prefill.
    prefill = []
    for rep in range(REPS):
        secs, r = c.post(prompt(200 + rep, PREFILL_TOKENS), 1)
        u = r.get("usage") or {}
        if u.get("prompt_tokens") not in (None, PREFILL_TOKENS):
            sys.exit(f"[{args.label}] prefill prompt counted {u.get('prompt_tokens')} tokens")
        if completion_tokens(u, 1) != 1:
            sys.exit(f"[{args.label}] prefill generated {u.get('completion_tokens')} tokens")
        tps = PREFILL_TOKENS / secs
        log(f"prefill rep {rep}: {PREFILL_TOKENS} tokens in {secs*1000:.0f} ms -> {tps:.1f} tok/s")
        prefill.append(tps)

    # (c) CONCURRENT streams at once.
    batch = []
    for rep in range(BATCH_REPS):
        results = [None] * CONCURRENT

        def one(i):
            results[i] = c.post(prompt(300 + 100 * rep + i, BATCH_PROMPT), BATCH_TOKENS)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(CONCURRENT)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        generated = 0
        for i, res in enumerate(results):
            if res is None:
                sys.exit(f"[{args.label}] concurrent request {i} failed")
            n = completion_tokens(res[1].get("usage"))
            if n != BATCH_TOKENS:
                sys.exit(f"[{args.label}] concurrent request {i} generated {n} tokens")
            generated += n
        tps = generated / wall
        log(f"{CONCURRENT} concurrent x {BATCH_TOKENS} rep {rep}: {generated} tokens in "
            f"{wall:.2f} s -> {tps:.2f} tok/s (slowest request {max(r[0] for r in results):.2f} s)")
        batch.append(tps)

    out = {
        "label": args.label,
        "decode_tps": statistics.median(decode),
        "decode_all": decode,
        "prefill_tps": statistics.median(prefill),
        "prefill_all": prefill,
        "batch_tps": statistics.median(batch),
        "batch_all": batch,
        "decode_text": texts[0],
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
