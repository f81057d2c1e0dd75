"""The quantization config of a GPTQ checkpoint, as AutoGPTQ, GPTQModel and HF
transformers write it, with GPTQModel's per-module `dynamic` overrides."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy

from .._checks import check_path, check_regular_file, is_integer, shown

try:  # matches with a time limit, which `re` cannot
    import regex
except ImportError:
    regex = None

# Where a checkpoint directory keeps its config, in the order readers look.
CONFIG_SOURCES = ("quantize_config.json", "quant_config.json", "config.json")
FORMATS = ("gptq", "gptq_v2")


def check_format(checkpoint_format: str, who: str) -> None:
    """The ValueError every taker of a checkpoint_format argument raises for one not in FORMATS."""
    if checkpoint_format not in FORMATS:
        raise ValueError(f"{who}: checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")


BITS = (2, 3, 4, 8)
OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")  # what a `dynamic` rule may change
# The keys that decide how the tensors read: a directory's config files must
# agree on them (transformers and vLLM take config.json's quant_method to
# pick the whole reader).
READING_KEYS = OVERRIDABLE + ("checkpoint_format", "lm_head", "dynamic", "quant_method")
# Other keys (true_sequential, static_groups, meta, damp_percent, ...) describe
# how a checkpoint was made, not how to read it, and are ignored; a rotation
# changes how it is run, and is refused (parse_config).
# The seconds one config's `dynamic` rules may spend matching module names, all
# calls together. A legitimate rule takes microseconds per name; a checkpoint's
# rules are untrusted, and a backtracking one can run for hours on one name.
RULE_MATCH_SECONDS = 5.0
# Compiling comes before that budget, and the `regex` module expands counted
# repeats: nested ones take memory in their product (((a{1000}){1000}){1000}
# exhausts any machine). Rules name module paths; none needs more than these.
RULE_MAX_CHARS = 1000
RULE_MAX_REPEATS = 10_000  # the product of a rule's counted-repeat bounds
# Group nesting: the compiler parses nested groups recursively, in Python, so
# how deep it gets depends on the interpreter's recursion limit (which torch
# raises while it compiles); a fixed bound decides the same everywhere.
RULE_MAX_DEPTH = 32
# All of one config's rules together: compiling takes about 2.5 ms per 1000
# characters, so a million rules would take minutes before any matching;
# a rule for each module of a large MoE model is a few hundred thousand.
RULES_MAX_CHARS = 2_000_000
_COUNTED_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
# An inline flag group, (?flags) or (?flags:...), "-" turning flags off.
_INLINE_FLAGS = re.compile(r"\(\?([a-zA-Z0-9-]+)[:)]")


class GPTQConfigError(ValueError):
    """A GPTQ quantization config is missing, unreadable or unsupported."""


class GPTQCheckpointError(ValueError):
    """A GPTQ checkpoint is missing tensors, has wrong shapes or dtypes, or is unreadable."""


def read_json(path: str, what: str, error: type = GPTQCheckpointError) -> dict[str, Any]:
    """The JSON object in `path`, a regular file (checked first); `error`
    naming the file if it cannot be read or parsed, or holds no object."""
    check_regular_file(path, what, GPTQCheckpointError)
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: arrays or objects nested too deeply
        raise error(f"{path}: unreadable {what}: {e}") from e
    if not isinstance(content, dict):
        raise error(f"{path}: the {what} must be a JSON object, got {type(content).__name__}")
    return content


@dataclass(frozen=True)
class ModuleQuant:
    """How one module is quantized."""
    bits: int
    group_size: int  # -1: one group over all of K
    desc_act: bool
    sym: bool


@dataclass(frozen=True)
class GPTQConfig:
    """A checkpoint's quantization_config (the HF / GPTQModel keys): how its
    weights are quantized and stored."""

    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"  # "gptq" (v1 zeros) or "gptq_v2"
    lm_head: bool = False  # the LM head is quantized too
    dynamic: dict[str, dict[str, Any]] = field(default_factory=dict)  # GPTQModel per-module overrides
    source: str = ""  # the file the config came from
    # Seconds of RULE_MATCH_SECONDS left, in a list so that the frozen config can spend them.
    _match_seconds: list = field(default_factory=lambda: [RULE_MATCH_SECONDS], init=False, repr=False,
                                 compare=False)
    # Each rule compiled once for this config (matching tries every rule on every module name).
    _patterns: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        """Refuses, as GPTQConfigError naming the config's file (`source`) or
        GPTQConfig, what no reader takes: bits without a packing, a
        group_size that is neither -1 nor positive, a flag that is not a
        bool, an unknown checkpoint_format, and malformed `dynamic` rules, so
        that a config made in code fails where it is made, not at save_gptq."""
        if not isinstance(self.source, str):
            raise GPTQConfigError(f"GPTQConfig: source must be a str, got {shown(self.source)}")
        where = self._where
        # numpy's integers and bools as Python's: the config is written as JSON.
        for key in ("bits", "group_size"):
            if is_integer(getattr(self, key)):
                object.__setattr__(self, key, int(getattr(self, key)))
        for key in ("desc_act", "sym", "lm_head"):
            if isinstance(getattr(self, key), numpy.bool_):
                object.__setattr__(self, key, bool(getattr(self, key)))
        if self.checkpoint_format not in FORMATS:
            raise GPTQConfigError(f"{where}: checkpoint_format {shown(self.checkpoint_format)} is not supported "
                                  f"(expected one of {FORMATS})")
        if not isinstance(self.lm_head, bool):
            raise GPTQConfigError(f"{where}: lm_head must be true or false, got {shown(self.lm_head)}")
        _validate(self.default, where)
        if not isinstance(self.dynamic, dict):
            raise GPTQConfigError(f"{where}: dynamic must be a dict of rules, got {shown(self.dynamic)}")
        total = sum(len(key) for key in self.dynamic if isinstance(key, str))
        if total > RULES_MAX_CHARS:
            raise GPTQConfigError(f"{where}: dynamic holds {len(self.dynamic)} rules of {total} characters together, "
                                  f"more than the {RULES_MAX_CHARS} that rules for every module of a large model need")
        for key, overrides in self.dynamic.items():
            if not isinstance(key, str):
                raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} must be a str (a module-name regex)")
            if not isinstance(overrides, dict):
                raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} must map to a dict, got {shown(overrides)}")
            self.pattern(key)
            if not key.startswith("-:"):
                _validate(replace(self.default, **{k: overrides[k] for k in OVERRIDABLE if k in overrides}),
                          f"{where}: dynamic rule {shown(key)}")

    @property
    def _where(self) -> str:
        """What errors about the config name: its file, or the class for one made in code."""
        return self.source or "GPTQConfig"

    @property
    def default(self) -> ModuleQuant:
        """The quantization of a module no `dynamic` rule matches."""
        return ModuleQuant(self.bits, self.group_size, self.desc_act, self.sym)

    def for_module(self, name: str) -> ModuleQuant | None:
        """The quantization of module `name`, None if `dynamic` excludes it.

        GPTQModel's rules: a key "-:regex" excludes matching modules, "+:regex"
        or a bare regex overrides bits / group_size / desc_act / sym; the first
        matching rule applies (re.match on the full module name). All
        matching of one config shares RULE_MATCH_SECONDS; past that it raises
        GPTQCheckpointError naming the config file and the rule.
        """
        for key, overrides in self.dynamic.items():
            if self._matches(key, name):
                if key.startswith("-:"):
                    return None
                return replace(self.default, **{k: overrides[k] for k in OVERRIDABLE if k in overrides})
        return self.default

    def _matches(self, key: str, name: str) -> bool:
        left = self._match_seconds
        start = time.monotonic()
        try:
            return self.pattern(key).match(name, timeout=max(left[0], 1e-3)) is not None
        except TimeoutError:
            raise GPTQCheckpointError(
                f"{self._where}: dynamic rule {shown(key)} did not finish matching module "
                f"names within {RULE_MATCH_SECONDS} s (all rules together); a pattern that backtracks "
                "catastrophically is refused") from None
        finally:
            left[0] -= time.monotonic() - start

    def pattern(self, key: str):
        """The compiled regex of `dynamic` rule `key`, compiled at its first use."""
        if key not in self._patterns:
            self._patterns[key] = _rule_pattern(key, self._where)
        return self._patterns[key]

    def to_dict(self) -> dict[str, Any]:
        """The config as an HF `quantization_config` dict."""
        out = {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
               "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": self.lm_head}
        if self.dynamic:
            out["dynamic"] = self.dynamic
        return out


def _rule_pattern(key: str, where: str):
    """The compiled regex of `dynamic` rule `key` (without its "-:" / "+:" prefix)."""
    if regex is None:
        raise GPTQConfigError(f"{where}: dynamic rules need the `regex` package (pip install regex), which "
                              "bounds how long a checkpoint's pattern may run")
    pattern = key[2:] if key[:2] in ("-:", "+:") else key
    _check_rule_size(pattern, key, where)
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} is not a valid regex: {e}") from e
    except RecursionError:  # the compiler recurses in Python: a stack already deep leaves it little room
        raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} nests its groups too deeply to compile "
                              "(a module-name pattern needs a few levels)") from None


def _check_rule_size(pattern: str, key: str, where: str) -> None:
    """Refuses a rule longer than RULE_MAX_CHARS, or whose counted repeats
    ({m}, {m,n}, {m,}) multiply to more than RULE_MAX_REPEATS, before it is
    compiled. Escaped characters hold no repeats; braces in a class or a
    comment count as repeats too: where the compiler ends a class (POSIX
    classes, V1's nested sets) or a comment is what a hostile rule hides
    repeats behind, and no module-name pattern has such braces. The verbose
    flag is refused: under it "{1 0}" repeats 10 times. Groups nest at most
    RULE_MAX_DEPTH deep (parentheses in a class count too)."""
    if len(pattern) > RULE_MAX_CHARS:
        raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} is {len(pattern)} characters long, more than "
                              f"the {RULE_MAX_CHARS} a module-name pattern needs")
    product, depth, i = 1, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        depth += (c == "(") - (c == ")")
        if depth > RULE_MAX_DEPTH:
            raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} nests its groups too deeply to compile (more "
                                  f"than {RULE_MAX_DEPTH} levels; a module-name pattern needs a few)")
        if c == "(" and (m := _INLINE_FLAGS.match(pattern, i)) and "x" in m.group(1):
            raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} sets the verbose flag (x), which a module-name "
                                  "pattern does not need (it hides repeats from the size check)")
        if c == "{" and (m := _COUNTED_REPEAT.match(pattern, i)):
            low, high = m.group(1), m.group(2)
            product *= max(1, int(high if high else low or 0))
            if product > RULE_MAX_REPEATS:
                raise GPTQConfigError(f"{where}: dynamic rule {shown(key)} repeats more than {RULE_MAX_REPEATS} times "
                                      "in its counted repeats together (compiling it would take memory in "
                                      "their product)")
            i = m.end()
            continue
        i += 1


def parse_config(raw: dict[str, Any], source: str = "") -> GPTQConfig:
    """A GPTQConfig from a quantize_config dict; raises GPTQConfigError naming `source`."""
    where = source or "quantization config"
    method = raw.get("quant_method", "gptq")
    if method != "gptq":
        raise GPTQConfigError(f"{where}: quant_method is {shown(method)}, not 'gptq'")
    _check_readable(raw, where)
    key = _format_key(raw)
    fmt = raw.get(key, "gptq")
    if fmt not in FORMATS:
        raise GPTQConfigError(f"{where}: {key} {shown(fmt)} is not supported (expected one of {FORMATS})")
    for key in ("bits", "group_size"):
        if key not in raw:
            raise GPTQConfigError(f"{where}: missing {key!r}")
    dynamic = raw.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise GPTQConfigError(f"{where}: dynamic must be a JSON object of rules, got {shown(dynamic)}")
    # The config checks its values as it is made (GPTQConfig.__post_init__), naming `where`.
    return GPTQConfig(
        bits=raw["bits"], group_size=raw["group_size"], desc_act=_flag(raw, "desc_act", False, where),
        sym=_flag(raw, "sym", True, where), checkpoint_format=fmt, lm_head=_flag(raw, "lm_head", False, where),
        dynamic=dict(dynamic), source=source,
    )


def _flag(raw: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A JSON boolean; null counts as absent. Strings like "false" are refused
    rather than read by truthiness (bool("false") is True)."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GPTQConfigError(f"{where}: {key} must be true or false, got {shown(value)}")
    return value


def check_bits_group_size(who: str, bits, group_size, error: type[ValueError] = ValueError) -> None:
    """Refuses, as `error` naming the argument, bits the packing has no
    layout for and a group_size that is neither -1 (one group) nor positive:
    a config's, a quantizer's and a layer's alike."""
    if not is_integer(bits) or bits not in BITS:
        raise error(f"{who}: bits must be one of {BITS}, got {shown(bits)}")
    if not is_integer(group_size) or not (group_size == -1 or group_size > 0):
        raise error(f"{who}: group_size must be -1 or a positive integer, got {shown(group_size)}")


def _validate(q: ModuleQuant, where: str) -> None:
    check_bits_group_size(where, q.bits, q.group_size, GPTQConfigError)
    for key in ("desc_act", "sym"):
        if not isinstance(getattr(q, key), bool):
            raise GPTQConfigError(f"{where}: {key} must be true or false, got {shown(getattr(q, key))}")


def read_config(directory: str | os.PathLike) -> GPTQConfig:
    """The quantization config of a checkpoint directory, from the first of
    quantize_config.json, quant_config.json, config.json["quantization_config"].
    Every other of those files that the directory has must agree with it on
    READING_KEYS (where both give one; no `dynamic` is no rules): a checkpoint whose files disagree
    reads as garbage in whichever library takes the other file, so it is
    refused naming both files and the key."""
    directory = check_path("read_config", directory, "directory", "directory")
    for index, name in enumerate(CONFIG_SOURCES):
        path = os.path.join(directory, name)
        if not os.path.lexists(path):
            continue
        raw = read_json(path, "config", GPTQConfigError)
        if name == "config.json":
            raw = raw.get("quantization_config")
            if raw is None:
                continue
        if not isinstance(raw, dict):
            raise GPTQConfigError(f"{path}: the quantization config must be a JSON object")
        _check_readable(raw, path)
        for other_path, other in _later_configs(directory, CONFIG_SOURCES[index + 1:]):
            _check_readable(other, other_path)
            for key in READING_KEYS:
                mine, theirs = _reading_value(raw, key), _reading_value(other, key)
                if mine is not None and theirs is not None and mine != theirs:
                    raise GPTQConfigError(f"{path} and {other_path} disagree on {key}: {shown(mine)} against "
                                          f"{shown(theirs)}; a checkpoint's config files must describe the same "
                                          "quantization")
        return parse_config(raw, path)
    raise GPTQConfigError(f"{directory}: no GPTQ config ({', '.join(CONFIG_SOURCES[:2])} or config.json "
                          "with quantization_config)")


def _check_readable(raw: dict[str, Any], where: str) -> None:
    """Refuses what any of a checkpoint's config files may say that other
    readers take differently: format keys that disagree, the Marlin layout, a rotation."""
    if "checkpoint_format" in raw and "format" in raw and raw["checkpoint_format"] != raw["format"]:
        # GPTQModel reads "format" first, vLLM "checkpoint_format" alone: readers would disagree.
        raise GPTQConfigError(f"{where}: checkpoint_format {shown(raw['checkpoint_format'])} and format "
                              f"{shown(raw['format'])} disagree")
    if raw.get("is_marlin_format"):
        # AutoGPTQ <= 0.7's name for checkpoint_format "marlin", as AutoGPTQ, GPTQModel and vLLM still read it.
        raise GPTQConfigError(f"{where}: is_marlin_format {shown(raw['is_marlin_format'])}: the checkpoint holds "
                              f"Marlin's repacked layout, which is not supported (expected one of {FORMATS})")
    if raw.get("rotation"):
        raise GPTQConfigError(f"{where}: rotation {shown(raw['rotation'])} is not supported: GPTQModel rotates such a "
                              "model's down_proj inputs at run time (an online Hadamard transform) to match its "
                              "weights")


def _later_configs(directory: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(path, quantization config) of each of `names` in `directory` that
    holds one; a file that cannot be read as one is left to the readers of
    that file to refuse (config.json: the model's config)."""
    found = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            raw = read_json(path, "config", GPTQConfigError) if os.path.lexists(path) else None
        except GPTQConfigError:
            continue
        if name == "config.json" and raw is not None:
            raw = raw.get("quantization_config")
        if isinstance(raw, dict):
            found.append((path, raw))
    return found


def _format_key(raw: dict[str, Any]) -> str:
    """The key a quantization config gives its zero format under (GPTQModel's quant_config.json: "format")."""
    return "checkpoint_format" if "checkpoint_format" in raw else "format"


def _reading_value(raw: dict[str, Any], key: str) -> Any:
    """raw's value for one of READING_KEYS, None where it gives none (the
    format under either of its names; `dynamic` always gives one: its rules
    in order, none where it has none)."""
    if key == "checkpoint_format":
        return raw.get(_format_key(raw))
    if key == "dynamic":  # in order: the first matching rule applies
        rules = raw.get("dynamic") or {}
        return list(rules.items()) if isinstance(rules, dict) else rules
    return raw.get(key)
