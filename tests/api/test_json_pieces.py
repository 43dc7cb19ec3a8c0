"""`json_pieces.loads_in_pieces`: a large body's parse, json.loads's result in pieces the event loop runs between."""

import json
import random
import threading
import time

import pytest

from jaxserve.api.errors import APIError, parse_json
from jaxserve.api.json_pieces import loads_in_pieces


def outcome(parse, body: bytes) -> tuple:
    try:
        return "value", json.dumps(parse(body))  # (NaN compares unequal to itself; its dump does not)
    except RecursionError:
        return ("too deep",)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        return ("invalid",)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth < 6 and kind < 0.25:
        return {rng.choice(["a", "b", "ключ", "k1", "k2", "\ud800"]): random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 4))}
    if depth < 6 and kind < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return rng.choice([None, True, False, 0, -1, 2.5e-300, 10**30, "s", 'é\n"\\', "", float("nan"),
                       float("-inf")])


def test_it_parses_what_json_loads_parses_and_refuses_what_it_refuses():
    rng = random.Random(0)
    for _ in range(3000):
        text = json.dumps(random_value(rng), indent=rng.choice([None, 0, 2]), ensure_ascii=rng.random() < 0.5)
        body = text.encode(rng.choice(["utf-8", "utf-16", "utf-32", "utf-8-sig"]), "surrogatepass")
        if rng.random() < 0.5 and body:  # an invalid body, most often
            at, edit = rng.randrange(len(body)), rng.random()
            body = (body[:at] + body[at + 1:] if edit < 0.3 else
                    body[:at] + bytes([rng.choice(b'{}[],:" \\\nx1-')]) + body[at:] if edit < 0.6 else body[:at])
        assert outcome(loads_in_pieces, body) == outcome(json.loads, body), body
    for body in (b"", b"  ", b"[1,]", b'["a",]', b'["a" "b"]', b'{"a": 1,}', b'{"a" 1}', b'{1: 2}', b"[1 2]",
                 b'{"a": [] x}', b'{"a": 1}  x', b"  [ ]  ", b' [ "a" , [ 1 ] , { } ] ', b"NaN", b"\xef\xbb\xbf{}",
                 b"\xef\xbb\xbf\xef\xbb\xbf{}", b'"\\ud800"', b'["\x01"]', b'["\xff"]', b"[" * 5000 + b"]" * 5000,
                 b'{"a": [[' + b"[" * 5000 + b"]" * 5000 + b"]]}", b"1" * 5000):
        assert outcome(loads_in_pieces, body) == outcome(json.loads, body), body


BODIES = {  # the shapes of large bodies: many messages, many strings, token ids, lists of token ids
    "messages": {"model": "m", "messages": [{"role": "user", "content": f"m{i}"} for i in range(40_000)]},
    "strings": {"model": "m", "input": [f"text {i}" for i in range(60_000)]},
    "token ids": {"model": "m", "prompt": list(range(200_000))},
    "lists of token ids": {"model": "m", "input": [list(range(i, i + 16)) for i in range(20_000)]},
}


@pytest.mark.parametrize("shape", BODIES)
def test_large_bodies_are_the_same_value_and_the_same_request(shape):
    body = json.dumps(BODIES[shape], indent=1).encode()
    assert loads_in_pieces(body) == json.loads(body) == parse_json(body)


def test_parse_json_refuses_a_large_invalid_body_as_a_small_one():
    for body in (json.dumps(BODIES["messages"])[:-3].encode(), b'{"x": "' + b"a" * 2**20 + b'\\ud800"}'):
        with pytest.raises(APIError) as info:
            parse_json(body)
        assert info.value.status == 400


def test_other_threads_run_while_a_large_body_is_parsed():
    """json.loads holds the interpreter lock for the whole parse: no other thread (the event loop) runs until
    it returns. In pieces, the lock passes at every switch interval."""
    body = json.dumps(BODIES["messages"]).encode()  # 1 MiB: tens of milliseconds to parse
    parsing, ticks = threading.Event(), []

    def tick() -> None:
        parsing.wait()
        while parsing.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    parsing.set()
    for _ in range(3):
        loads_in_pieces(body)
    parsing.clear()
    ticker.join()
    assert len(ticks) >= 6, len(ticks)
