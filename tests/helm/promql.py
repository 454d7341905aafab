"""A small PromQL evaluator for the subset kvserve's Grafana dashboard uses, over scraped
samples held in memory (no PromQL parser is packaged for Python; this one parses the
query into a tree and evaluates it with Prometheus's documented semantics).

Supported: number literals; vector selectors with label matchers (= != =~ !~, regexes
fully anchored as in Prometheus) and a range `[1m]`; rate / increase (Prometheus's
extrapolated rate, counter resets included); histogram_quantile (Prometheus's bucket
interpolation); the aggregations sum / max / min / avg / count with `by (...)` or
`without (...)` before or after the arguments; + - * / between scalars and vectors
(one-to-one on equal label sets, or `on (...)` / `ignoring (...)`). Anything else is a
ParseError naming it, so a dashboard query outside the subset fails the test loudly
instead of being evaluated wrongly.

Instant selectors take the newest sample within the 5-minute lookback unless it is a
staleness marker (a series gone from its target's latest scrape); range selectors the
samples in (t - range, t] (left-open, Prometheus 3), markers left out.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LOOKBACK_S = 300.0
# Prometheus's staleness marker: a NaN with this bit pattern; here the float NaN suffices,
# as scraped values are never NaN in these tests.
STALE = math.nan
AGGREGATIONS = ("sum", "max", "min", "avg", "count")
Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]


class ParseError(ValueError):
    pass


@dataclass
class Series:
    labels: dict[str, str]  # __name__ included
    samples: list[tuple[float, float]] = field(default_factory=list)  # (t, value), t ascending


# ----------------------------------------------------------------------------- lexer

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?![a-zA-Z_:])
  | (?P<duration>\[\s*\d+(?:ms|s|m|h|d)\s*\])
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|[=,(){}+\-*/])
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
""", re.VERBOSE)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ParseError(f"cannot read {text[pos:pos + 20]!r} in {text!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group()))
    return out


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"\[\s*(\d+)(ms|s|m|h|d)\s*\]", duration)
    assert m is not None
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


# ----------------------------------------------------------------------------- parser
# Nodes are tuples: ("num", v) ("sel", name, matchers, range_s|None) ("call", fn, args)
# ("agg", op, "by"|"without"|None, labels, arg) ("bin", op, lhs, rhs, "on"|"ignoring"|None, labels)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "")

    def take(self, value: str | None = None) -> str:
        kind, tok = self.peek()
        if kind == "eof" or (value is not None and tok != value):
            raise ParseError(f"expected {value or 'a token'} at token {self.i} of {self.text!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Any:
        node = self.expr()
        if self.peek()[0] != "eof":
            raise ParseError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return node

    def expr(self) -> Any:
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            node = self.binary(self.take(), node, self.term)
        return node

    def term(self) -> Any:
        node = self.primary()
        while self.peek()[1] in ("*", "/"):
            node = self.binary(self.take(), node, self.primary)
        return node

    def binary(self, op: str, lhs: Any, rhs: Callable[[], Any]) -> Any:
        matching, labels = None, ()
        if self.peek()[1] in ("on", "ignoring"):
            matching = self.take()
            labels = self.label_list()
        if self.peek()[1] in ("group_left", "group_right", "bool"):
            raise ParseError(f"{self.peek()[1]} is outside the supported subset: {self.text!r}")
        return ("bin", op, lhs, rhs(), matching, labels)

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        labels = []
        while self.peek()[1] != ")":
            labels.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(labels)

    def primary(self) -> Any:
        kind, tok = self.peek()
        if kind == "number":
            self.take()
            return ("num", float(tok))
        if tok == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        if kind != "ident":
            raise ParseError(f"unexpected {tok!r} in {self.text!r}")
        self.take()
        if tok in AGGREGATIONS:
            return self.aggregation(tok)
        if self.peek()[1] == "(":
            self.take("(")
            args = [self.expr()]
            while self.peek()[1] == ",":
                self.take(",")
                args.append(self.expr())
            self.take(")")
            if tok not in _FUNCTIONS:
                raise ParseError(f"function {tok}() is outside the supported subset: {self.text!r}")
            return ("call", tok, args)
        return self.selector(tok)

    def aggregation(self, op: str) -> Any:
        grouping, labels = None, ()
        if self.peek()[1] in ("by", "without"):
            grouping = self.take()
            labels = self.label_list()
        self.take("(")
        arg = self.expr()
        if self.peek()[1] == ",":
            raise ParseError(f"{op} with a parameter is outside the supported subset: {self.text!r}")
        self.take(")")
        if grouping is None and self.peek()[1] in ("by", "without"):
            grouping = self.take()
            labels = self.label_list()
        return ("agg", op, grouping, labels, arg)

    def selector(self, name: str) -> Any:
        matchers = [("__name__", "=", name)]
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label, op, value = self.take(), self.take(), self.take()
                if op not in ("=", "!=", "=~", "!~") or not value.startswith('"'):
                    raise ParseError(f"bad matcher {label}{op}{value} in {self.text!r}")
                matchers.append((label, op, bytes(value[1:-1], "utf-8").decode("unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        range_s = _seconds(self.take()) if self.peek()[0] == "duration" else None
        return ("sel", name, tuple(matchers), range_s)


def parse(text: str) -> Any:
    return _Parser(text).parse()


# ----------------------------------------------------------------------------- evaluation


def _matches(labels: dict[str, str], matchers: tuple[tuple[str, str, str], ...]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def _key(labels: dict[str, str], drop_name: bool = True) -> Labels:
    return frozenset((k, v) for k, v in labels.items() if not (drop_name and k == "__name__"))


def extrapolated_rate(samples: list[tuple[float, float]], start: float, end: float, is_rate: bool) -> float | None:
    """Prometheus's extrapolatedRate (promql/functions.go) for a counter."""
    if len(samples) < 2:
        return None
    result = samples[-1][1] - samples[0][1]
    for (_, a), (_, b) in zip(samples, samples[1:]):
        if b < a:  # a counter reset: the counter restarted from zero
            result += a
    first_t, last_t = samples[0][0], samples[-1][0]
    sampled = last_t - first_t
    average = sampled / (len(samples) - 1)
    threshold = average * 1.1
    to_start, to_end = first_t - start, end - last_t
    if to_start >= threshold:
        to_start = average / 2
    if result > 0 and samples[0][1] >= 0:
        to_zero = sampled * (samples[0][1] / result)
        to_start = min(to_start, to_zero)
    if to_end >= threshold:
        to_end = average / 2
    factor = (sampled + to_start + to_end) / sampled
    if is_rate:
        factor /= end - start
    return result * factor


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile over (upper bound, cumulative count) pairs."""
    if math.isnan(q) or not buckets:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if buckets[-1][0] != math.inf:
        return math.nan
    observations = buckets[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0] if len(buckets) > 1 else math.nan
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end = (0.0, buckets[0][0]) if b == 0 else (buckets[b - 1][0], buckets[b][0])
    below = 0.0 if b == 0 else buckets[b - 1][1]
    count = buckets[b][1] - below
    return start + (end - start) * ((rank - below) / count) if count else end


def _histogram_quantile(q: float, vector: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, value in vector.items():
        le = dict(labels).get("le")
        if le is None:
            continue
        rest = frozenset((k, v) for k, v in labels if k != "le")
        groups.setdefault(rest, []).append((float(le), value))
    return {labels: bucket_quantile(q, buckets) for labels, buckets in groups.items()}


_FUNCTIONS = ("rate", "increase", "histogram_quantile")


class Evaluator:
    """Evaluates parsed queries over the series Prometheus stored (one per target and
    label set, target labels included)."""

    def __init__(self, series: list[Series]) -> None:
        self.series = series

    def query(self, text: str, at: float) -> Vector | float:
        return self.eval(parse(text), at)

    def eval(self, node: Any, t: float) -> Vector | float:
        kind = node[0]
        if kind == "num":
            return node[1]
        if kind == "sel":
            if node[3] is not None:
                raise ParseError("a range selector outside rate()/increase()")
            out: Vector = {}
            for s in self.series:
                if _matches(s.labels, node[2]):
                    recent = [v for ts, v in s.samples if t - LOOKBACK_S < ts <= t]
                    if recent and not math.isnan(recent[-1]):
                        out[_key(s.labels, drop_name=False)] = recent[-1]
            return out
        if kind == "call":
            return self.call(node[1], node[2], t)
        if kind == "agg":
            return self.aggregate(node, t)
        return self.binary(node, t)

    def call(self, fn: str, args: list[Any], t: float) -> Vector:
        if fn in ("rate", "increase"):
            (sel,) = args
            if sel[0] != "sel" or sel[3] is None:
                raise ParseError(f"{fn}() needs a range selector")
            out: Vector = {}
            for s in self.series:
                if _matches(s.labels, sel[2]):
                    window = [(ts, v) for ts, v in s.samples if t - sel[3] < ts <= t and not math.isnan(v)]
                    value = extrapolated_rate(window, t - sel[3], t, is_rate=fn == "rate")
                    if value is not None:
                        out[_key(s.labels)] = value
            return out
        q, vector = self.eval(args[0], t), self.eval(args[1], t)
        assert isinstance(q, float) and isinstance(vector, dict)
        return _histogram_quantile(q, vector)

    def aggregate(self, node: Any, t: float) -> Vector:
        _, op, grouping, labels, arg = node
        vector = self.eval(arg, t)
        assert isinstance(vector, dict), f"{op} over a scalar"
        groups: dict[Labels, list[float]] = {}
        for key, value in vector.items():
            if grouping is None:
                group = frozenset()
            elif grouping == "by":
                group = frozenset((k, v) for k, v in key if k in labels)
            else:
                group = frozenset((k, v) for k, v in key if k not in labels and k != "__name__")
            groups.setdefault(group, []).append(value)
        reduce: dict[str, Callable[[list[float]], float]] = {
            "sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v), "count": len}
        return {group: float(reduce[op](values)) for group, values in groups.items()}

    def binary(self, node: Any, t: float) -> Vector | float:
        _, op, lhs_node, rhs_node, matching, labels = node
        lhs, rhs = self.eval(lhs_node, t), self.eval(rhs_node, t)
        apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
                 "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}[op]
        if isinstance(lhs, float) and isinstance(rhs, float):
            return apply(lhs, rhs)
        if isinstance(lhs, float):
            return {k: apply(lhs, v) for k, v in rhs.items()}  # type: ignore[union-attr]
        if isinstance(rhs, float):
            return {k: apply(v, rhs) for k, v in lhs.items()}

        def match_key(key: Labels) -> Labels:
            if matching == "on":
                return frozenset((k, v) for k, v in key if k in labels)
            return frozenset((k, v) for k, v in key if k not in labels and k != "__name__")

        right: dict[Labels, tuple[Labels, float]] = {}
        for key, value in rhs.items():
            if match_key(key) in right:
                raise ParseError("many-to-many matching is outside the supported subset")
            right[match_key(key)] = (key, value)
        out: Vector = {}
        for key, value in lhs.items():
            if match_key(key) in right:
                result_key = match_key(key) if matching == "on" else frozenset((k, v) for k, v in key if k != "__name__")
                out[result_key] = apply(value, right[match_key(key)][1])
        return out
