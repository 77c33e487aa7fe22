"""The serving profile: its schema, and loading it from TOML with ``extends``.

A profile is a TOML file (read with tomlkit, so ``flatshare profiles set``
can edit it with comments kept). A profile may name a parent with
``extends = "other.toml"`` (relative to its own directory); tables merge
key by key, the child's values winning, so a variant states only what
differs. The merged document is validated strictly by the pydantic models
below: unknown keys, wrong types, out-of-range values and combinations
known to crash are errors that name the file, the line and the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import tomlkit
import tomlkit.exceptions
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..common.text import control_character
from ..errors import ProfileError
from ..schema_errors import dotted, ordered, rule, spelled

# --- value types -----------------------------------------------------------


def _no_control_chars(value: str) -> str:
    # docs/reference/systemd.md, "Unit file syntax": a newline in a value
    # starts a new directive and a trailing backslash continues a line; no
    # control character is ever wanted in a unit, so reject them all at the edge.
    found = control_character(value)
    if found:
        raise ValueError(f"must not contain control character {found!r}")
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {spelled(value)}")
    return value


Text = Annotated[str, Field(min_length=1), AfterValidator(_no_control_chars)]
AbsPath = Annotated[Text, AfterValidator(_absolute)]


def host_problem(value: str) -> str | None:
    """Why ``value`` is no host a node can be reached at, or None: an IP address (IPv6 without brackets), or a
    host name of dot-separated labels of 1 to 63 letters, digits and '-', neither starting nor ending with '-',
    253 characters at most (RFC 1035 section 2.3.1, RFC 1123 section 2.1; Python's idna codec refuses an empty
    or longer label at connect time, before any lookup)."""
    import ipaddress

    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if len(value) > 253 or not all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x) for x in labels):
        return (f"must be an IP address or a host name (dot-separated labels of 1 to 63 letters, digits and '-', "
                f"not starting or ending with '-'), got {spelled(value)}")
    return None


def _host(value: str) -> str:
    problem = host_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _http_base(value: str) -> str:
    # http://HOST:PORT and nothing more: the node's own service, reached by urllib (docs/reference/profile-values.md).
    from urllib.parse import urlsplit

    wrong = (f"must be http://HOST:PORT (a host name or an IP address, [IPv6] in brackets, and a port from 1 to "
             f"65535; no path), got {spelled(value)}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError(wrong) from None
    host = parts.hostname or ""
    if parts.scheme != "http" or port is None or not 1 <= port <= 65535 or parts.username is not None \
            or parts.password is not None or parts.path or parts.query or parts.fragment or "#" in value \
            or "?" in value or value != f"http://{parts.netloc}" or host_problem(host) is not None \
            or (":" in host) != parts.netloc.startswith("["):
        raise ValueError(wrong)
    return value


#: The longest value of one engine environment entry (characters): one entry of exec(2)'s environment may
#: hold 128 KiB (MAX_ARG_STRLEN), which this keeps any UTF-8 text under.
ENVIRONMENT_VALUE_MAX = 32768


def _environment_value(value: str) -> str:
    if len(value) > ENVIRONMENT_VALUE_MAX:
        raise ValueError(f"must be at most {ENVIRONMENT_VALUE_MAX} characters (one entry of the engine's environment, "
                         f"which exec(2) bounds), got {len(value)}")
    return value


#: A host a node's SSH server or service is reached at (:func:`host_problem`).
Host = Annotated[str, AfterValidator(_host)]
Command = Annotated[list[Text], Field(min_length=1)]
#: A time span: at least 1 ms (systemd reads a span that renders as 0 as "no timeout": systemd.service(5),
#: docs/reference/systemd.md), at most a day.
Seconds = Annotated[float, Field(ge=0.001, le=86400)]
#: Counts (tokens, sequences, milliseconds): non-negative and within a 32-bit int.
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Positive = Annotated[int, Field(gt=0, le=2**31 - 1)]


def _no_dollar(value: str) -> str:
    # systemd expands $VAR in ExecStart= words, and "$$" is not undone in the
    # program path: a program path holding "$" cannot be written reliably.
    if "$" in value:
        raise ValueError(f"a program path must not contain '$', got {spelled(value)}")
    return value


def _command_is_absolute(argv: list[str]) -> list[str]:
    _no_dollar(_absolute(argv[0]))
    return argv


ExecCommand = Annotated[Command, AfterValidator(_command_is_absolute)]


class StrictModel(BaseModel):
    """Base of every profile table: no unknown keys, no type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# --- the tables ------------------------------------------------------------


class MakeRoom(StrictModel):
    """make-room's settings, passed as ``--additional-config.make_room.KEY``."""

    retain_tokens: Count = Field(description="tokens of a finished turn's prefix kept on the GPU")
    retain_s: Count = Field(description="seconds the retained prefix is kept at most")
    hint_hold_ms: Count = Field(description="ms agents' prefill is held after a turn hint")
    take_reservations: bool
    decode_hold_tokens: Count = Field(description="tokens of a voice reply agents' decodes stay out of")
    recompute_tokens: Count = Field(description="0 turns recompute off")


class FlatshareJit(StrictModel):
    """The JIT batch scheduler's settings, ``--additional-config.flatshare_jit.KEY``."""

    margin_ms: Count
    step_time_model: AbsPath


class KvOffloading(StrictModel):
    """The CPU KV tier (vLLM ``--kv-offloading-size`` GiB, ``--kv-offloading-backend``)."""

    enabled: bool
    size_gib: float = Field(gt=0, le=65536)
    backend: Literal["native", "lmcache"]


class Speculative(StrictModel):
    """Speculative decoding (vLLM ``--speculative-config``): a switch, off in production.

    Measured with EAGLE-3 and two drafts and kept off (docs/reference/profile-values.md#not-adopted);
    when on, the calls' short loads are recomputed through ``make_room.recompute_tokens``.
    """

    enabled: bool
    method: Literal["eagle3"]
    model: AbsPath = Field(description="the draft model's path on the node")
    num_speculative_tokens: Positive = Field(description="speculative tokens per step")

    def vllm_config(self) -> dict:
        """The ``--speculative-config`` object vLLM reads (its keys: method, model, num_speculative_tokens)."""
        return {"method": self.method, "model": self.model, "num_speculative_tokens": self.num_speculative_tokens}


class GenerationDefaults(StrictModel):
    """The sampling defaults the engine gives a request for what it does not set itself: vLLM's
    ``--override-generation-config``, applied over the model's ``generation_config.json``.

    Only the keys vLLM 0.32.0 reads from it (vllm/config/model.py ``get_diff_sampling_param``:
    repetition, presence and frequency penalties, temperature, top_k, top_p, min_p, max_new_tokens); vLLM drops any
    other key without a word, so none is taken here. A request's own value wins: the golden answers ask for
    temperature 0, and a changed penalty still changes them. None set (the default): the model's own defaults, and
    no flag is rendered.
    """

    repetition_penalty: float | None = Field(default=None, gt=0, le=10, description="1 leaves tokens unpenalised")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    temperature: float | None = Field(default=None, ge=0, le=10)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1, description="-1 or 0: every token")
    top_p: float | None = Field(default=None, gt=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_new_tokens: Positive | None = Field(default=None, description="vLLM's max_tokens for a request without one")

    def vllm_config(self) -> dict:
        """The ``--override-generation-config`` object vLLM reads: the keys set, none of the unset ones."""
        return {key: value for key, value in self.model_dump().items() if value is not None}


class Engine(StrictModel):
    """The vLLM engine: what ``vllm serve`` is started with."""

    vllm_release: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")]
    venv: Annotated[AbsPath, AfterValidator(_no_dollar)]
    model: Text
    served_model_name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9._/-]+$")]
    host: Annotated[Text, Field(pattern=r"^[A-Za-z0-9.:-]+$")]
    port: int = Field(ge=1, le=65535)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    max_model_len: Positive
    max_num_seqs: Positive
    max_num_batched_tokens: Positive
    enable_prefix_caching: bool
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"]
    async_scheduling: bool
    #: vLLM ``--enforce-eager``: no torch.compile and no CUDA graphs (rendered ``--enforce-eager`` /
    #: ``--no-enforce-eager``). Production keeps it off (CUDA graphs are part of its step time).
    enforce_eager: bool = False
    attention_backend: Annotated[str, Field(pattern=r"^[A-Z0-9_]+$")]
    scheduler_cls: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")]
    start_timeout_s: Seconds
    stop_timeout_s: Seconds
    environment: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
                      Annotated[Text, AfterValidator(_environment_value)]] = Field(default_factory=dict)
    kv_offloading: KvOffloading
    make_room: MakeRoom
    flatshare_jit: FlatshareJit
    speculative: Speculative | None = None
    override_generation_config: GenerationDefaults = Field(default_factory=GenerationDefaults)

    @model_validator(mode="after")
    def _environment_leaves_what_the_renderer_sets(self) -> "Engine":
        # The engine unit sets PYTHONPATH to the serve module's directory (render/units.py): a profile value
        # would be silently overridden, so it is refused.
        if "PYTHONPATH" in self.environment:
            raise ValueError("environment: PYTHONPATH is set by the renderer (to module.directory, where the "
                             "serve module is built); remove it, or change module.directory")
        return self

    @model_validator(mode="after")
    def _batch_holds_every_sequence(self) -> "Engine":
        # vLLM's scheduler config refuses max_num_batched_tokens < max_num_seqs at start.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}; vLLM refuses to start otherwise"
            )
        return self

    @model_validator(mode="after")
    def _fp8_kv_crashes_with_async_and_cpu_tier(self) -> "Engine":
        # docs/reference/profile-values.md#fp8-kv-cache: FP8 KV crashes under async scheduling with the CPU tier
        # (a FlashInfer plan race in stock vLLM; the fix, vLLM #64165, is not merged).
        if self.kv_cache_dtype.startswith("fp8") and self.async_scheduling and self.kv_offloading.enabled:
            raise ValueError(
                "kv_cache_dtype: fp8 with async_scheduling and kv_offloading crashes "
                "(FlashInfer plan race, vLLM #64165 not merged); use kv_cache_dtype = \"auto\" "
                "or turn off async_scheduling or kv_offloading"
            )
        return self


class Module(StrictModel):
    """Flatshare's make-room serve module, built at engine start and pinned by hash."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    directory: AbsPath
    path: AbsPath
    build_command: ExecCommand
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]

    @model_validator(mode="after")
    def _path_inside_directory(self) -> "Module":
        if not self.path.startswith(self.directory.rstrip("/") + "/"):
            raise ValueError(f"path {self.path!r} must lie inside directory {self.directory!r}")
        return self


#: An HTTP base URL a node reaches one of its own services at (no path): ``http://HOST:PORT``.
HttpBase = Annotated[str, AfterValidator(_http_base)]


class Gateway(StrictModel):
    """The HTTP gateway in front of the engine: what callers meet.

    ``url`` is where the node's callers reach it (``URL/health`` answers 200 while it takes calls):
    the admission to drain asks it, not the gateway's unit state (docs/reference/release-protocol.md,
    "Admission to drain"). It names the node itself: its loopback, or the host the inventory reaches it
    at (a release of a profile naming another host is refused: control/rollout.py ``refuse_foreign_gateways``).
    """

    command: ExecCommand
    url: HttpBase
    drain_timeout_s: Seconds


class Voice(StrictModel):
    """The voice worker: takes calls and announces each user turn."""

    command: ExecCommand
    turn_hints: bool
    drain_timeout_s: Seconds = Field(description="how long a release waits for the worker's calls to end")
    endpointing_min_s: Seconds
    endpointing_max_s: Seconds

    @model_validator(mode="after")
    def _endpointing_ordered(self) -> "Voice":
        if self.endpointing_min_s > self.endpointing_max_s:
            raise ValueError(
                f"endpointing_min_s: must be <= endpointing_max_s ({self.endpointing_max_s}), "
                f"got {self.endpointing_min_s}"
            )
        return self


class Check(StrictModel):
    """serving-check's timer and command on each node."""

    command: ExecCommand
    interval_s: int = Field(ge=10, le=86400)


def _journal_or_directory(value: str) -> str:
    # systemd.exec(5) StandardOutput=append:PATH takes the rest of the line as the path: no whitespace.
    if value == "journal":
        return value
    if not value.startswith("/") or any(c.isspace() for c in value):
        raise ValueError(f'must be "journal" or an absolute directory path without spaces, got {spelled(value)}')
    return value


class Layout(StrictModel):
    """Where a node keeps units, state and runtime files, and which manager runs them.

    ``output`` is where the services' output goes: ``"journal"`` (systemd's default, read with
    ``journalctl``) or a directory, where each service appends to ``UNIT.log`` (``StandardOutput=append:``;
    a manager without journald, as the sandbox's, has nowhere else to put it). The node's switch and
    serving-check quote the engine's last lines from there (:mod:`flatshare_ops.common.unit_output`).
    """

    scope: Literal["system", "user"]
    unit_dir: AbsPath
    state_dir: AbsPath
    run_dir: AbsPath
    service_user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]*$")] | None = None
    output: Annotated[Text, AfterValidator(_journal_or_directory)] = "journal"

    @model_validator(mode="after")
    def _state_dir_is_one_plain_path(self) -> "Layout":
        # A system-scope engine unit names the engine's home under it in StateDirectory= (render/units.py),
        # which systemd splits at whitespace and ignores unless normalized (systemd.exec(5)); a user-scope node
        # (a sandbox in a directory whose path has a space) renders none.
        parts = self.state_dir.split("/")[1:]
        if not parts or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"state_dir: {spelled(self.state_dir)} is not a normalized path (no '.', '..', '//' or "
                             "trailing '/'); write it as /var/lib/NAME")
        if self.scope == "system" and any(c.isspace() for c in self.state_dir):
            raise ValueError(f"state_dir: {spelled(self.state_dir)} holds whitespace, which systemd's "
                             "StateDirectory= reads as two directories; choose a path without it")
        return self

    @model_validator(mode="after")
    def _run_dir_is_what_runtime_directory_makes(self) -> "Layout":
        # The units recreate run_dir at boot with RuntimeDirectory=NAME (its last component), which systemd
        # makes under /run for the system manager and under $XDG_RUNTIME_DIR for a user manager
        # (systemd.exec(5), docs/reference/systemd.md): the path must be normalized and its name one plain
        # word (systemd splits the setting at spaces). Its parent is the manager's runtime root (/run for
        # the system manager); that is not checked here, since the sandbox's system-scope node runs a
        # manager whose runtime root is a directory of its own.
        path = PurePosixPath(self.run_dir)
        parts = self.run_dir.split("/")[1:]
        if not parts or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"run_dir: {self.run_dir!r} is not a normalized path (no '.', '..', '//' or "
                             "trailing '/'); write it as /run/NAME")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", path.name):
            raise ValueError(f"run_dir: its last part {path.name!r} must be one plain word ([A-Za-z0-9._-]): "
                             "it is the units' RuntimeDirectory= name")
        return self


class Golden(StrictModel):
    """Golden answers: prompts sent with greedy sampling (``temperature`` 0) to the canary and the baseline (or
    the canary's reference answers) during a canary analysis, their generated token ids compared (vLLM's
    ``return_token_ids``, docs/reference/vllm.md#completions). A difference fails the analysis unless the
    release is said to change answers (``flatshare release --changes-answers``). No prompts: no check."""

    prompts: list[str] = Field(default_factory=list, max_length=16, description=(
        "prompts whose greedy answers a release must leave the same (at most 16, each 1 to 2000 characters)"))
    max_tokens: int = Field(16, ge=1, le=256, description="tokens generated for each prompt (1 to 256)")

    @model_validator(mode="after")
    def _prompts_sized(self) -> "Golden":
        for number, prompt in enumerate(self.prompts, 1):
            if not 1 <= len(prompt) <= 2000 or not prompt.strip():
                raise ValueError(f"prompts: prompt {number} must be 1 to 2000 characters and not only blanks, "
                                 f"got {len(prompt)} character(s)")
        return self


class Analysis(StrictModel):
    """The canary's analysis in a rollout (``release --all``), and the thresholds the alert rules share.

    Measurements are read from the engine's own metrics (docs/reference/vllm.md#metrics):
    ``vllm:time_to_first_token_seconds`` (a histogram), ``vllm:request_success_total`` by
    ``finished_reason``. Semantics follow Argo Rollouts' analysis (docs/reference/canary-analysis.md;
    :mod:`flatshare_ops.control.analysis` applies them): ``count`` measurements every ``interval_s``; the
    analysis fails once more than ``failure_limit`` of them failed, or once ``consecutive_error_limit`` in a
    row could not be taken; a measurement with fewer than ``min_requests`` requests is inconclusive; after
    ``count`` measurements, more than ``inconclusive_limit`` of them neither passed nor failed makes the
    analysis inconclusive, and ``inconclusive`` says what that does. ``failure_limit + inconclusive_limit``
    is below ``count``, so a passing analysis has at least one passed measurement.
    """

    # Bounds of the wall time an analysis takes: a measurement scrapes two nodes over SSH, about a second (so
    # each waits at least that long), and each scrape is bounded (control/canary.py): count x (interval_s or a
    # measurement's bound) stays bounded, where count x interval_s alone would not (86,400,000 x 0.001 s, at
    # 3 s a measurement, is years).
    interval_s: float = Field(ge=1, le=3600, description="seconds between measurements (each covers one interval)")
    count: int = Field(gt=0, le=100, description="measurements in one analysis (at most 100)")
    min_requests: Positive = Field(description="fewer requests finished in a measurement: inconclusive")
    ttft_p95_max_s: Seconds = Field(description="time to first token, p95, at most (seconds)")
    error_share_max: float = Field(ge=0, le=1, description="share of requests ending in error or abort, at most")
    baseline_factor: float = Field(ge=1, le=100, description="canary p95 at most this times the baseline's ...")
    baseline_margin_s: float = Field(ge=0, le=3600, description="... plus this many seconds")
    failure_limit: Count = Field(description="failed measurements tolerated (Argo's failureLimit)")
    inconclusive_limit: Count = Field(
        description="measurements that neither passed nor failed (inconclusive or not taken) tolerated "
                    "(Argo's inconclusiveLimit)")
    consecutive_error_limit: Positive = Field(
        description="this many measurements in a row that could not be taken fail the analysis")
    inconclusive: Literal["fail", "pause", "pass"] = Field(description="what an inconclusive analysis does")
    golden: Golden = Field(default_factory=Golden)

    @model_validator(mode="after")
    def _limits_below_count(self) -> "Analysis":
        # Argo Rollouts does not check this; an analysis that can never fail, or can pass without a single
        # passed measurement, is a profile mistake worth one line.
        if self.failure_limit + self.inconclusive_limit >= self.count:
            raise ValueError(f"failure_limit|inconclusive_limit|count: failure_limit + inconclusive_limit must be "
                             f"below count ({self.count}), "
                             f"got {self.failure_limit} + {self.inconclusive_limit}; a passing analysis needs a "
                             "passed measurement")
        if self.count * self.interval_s > 86400:
            raise ValueError(f"count|interval_s: the analysis would take count x interval_s = "
                             f"{self.count * self.interval_s:g} s, more than a day (86400 s); a rollout waits for it")
        return self


class Admission(StrictModel):
    """Whether the nodes that would carry a draining node's calls have the room for them (the operator's
    admission to drain, control/rollout.py), read from each engine's own gauges (vLLM's
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``). The defaults
    never refuse an idle fleet."""

    seats_share: float = Field(2.0, gt=0, le=10, description=(
        "the others' running + waiting requests, with the draining node's moved onto them, stay within this "
        "many times their max_num_seqs (2: a full batch running and one more waiting behind it)"))
    kv_cache_max: float = Field(0.95, gt=0, le=1, description=(
        "a node whose KV cache is used above this share takes no other node's calls"))


class Release(StrictModel):
    """How a release of this profile is judged: rolled back by the node itself, and analysed as a canary."""

    auto_rollback: bool = Field(description="a switch whose engine does not serve goes back by itself")
    analysis: Analysis
    admission: Admission = Field(default_factory=Admission)


class Card(StrictModel):
    """The GPU the profile is tuned for."""

    name: Text
    memory_gib: int = Field(gt=0, le=4096)


class Profile(StrictModel):
    """A whole serving profile, after ``extends`` is resolved."""

    schema_: Literal[1] = Field(alias="schema")
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")]
    description: Text | None = None
    card: Card
    engine: Engine
    module: Module
    gateway: Gateway
    voice: Voice
    check: Check
    layout: Layout
    release: Release

    @model_validator(mode="after")
    def _scheduler_in_module(self) -> "Profile":
        top = self.engine.scheduler_cls.split(".", 1)[0]
        if top != self.module.name:
            raise ValueError(
                f"engine.scheduler_cls {self.engine.scheduler_cls!r} is not in module {self.module.name!r}"
            )
        return self


# --- loading ---------------------------------------------------------------


@dataclass
class LoadedProfile:
    """A validated profile with where each of its keys came from.

    Attributes:
        profile: the validated model.
        path: the file that was loaded (the leaf of the ``extends`` chain).
        chain: every file read, leaf first.
        data: the merged plain-Python document (what ``profile`` was built from).
        origins: dotted key -> (file, line) where the winning value was written.
    """

    profile: Profile
    path: Path
    chain: list[Path]
    data: dict[str, Any]
    origins: dict[str, tuple[Path, int]] = field(default_factory=dict)

    def sha256(self) -> str:
        """sha256 (hex) of the resolved profile as canonical JSON (sorted keys).

        Two profiles that resolve to the same values have the same hash, however
        their ``extends`` chain spells them.
        """
        canonical = json.dumps(self.data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def key_lines(text: str) -> dict[str, int]:
    """Map each dotted key in a TOML text to the 1-based line it is written on.

    A small scanner, not a parser: it follows ``[table]`` headers and
    ``key = value`` lines, which is how profiles are written. Keys inside
    inline tables or multi-line arrays map to the line their parent key starts on.
    """
    lines: dict[str, int] = {}
    table: str = ""
    header = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\" ]+?)\s*\]\s*(#.*)?$")
    assign = re.compile(r"^\s*([A-Za-z0-9_\-\"]+(?:\s*\.\s*[A-Za-z0-9_\-\"]+)*)\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        if m := header.match(line):
            table = _dotted(m.group(1))
            lines.setdefault(table, number)
        elif m := assign.match(line):
            key = _dotted(m.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def _dotted(key: str) -> str:
    return ".".join(part.strip().strip('"') for part in key.split("."))


#: tomlkit's bound on how deep a TOML value nests (its ParseError "TOML value nested more than 100 levels deep");
#: the standard library's parser has none.
TOML_DEPTH = 100


def _depth(value: Any, level: int = 0) -> int:
    """How deep ``value`` (tomllib's data) nests, every table and array a level (tomlkit counts only values, so
    this is never less than its count); stops past :data:`TOML_DEPTH`."""
    if level > TOML_DEPTH or not isinstance(value, (dict, list)):
        return level
    items = value.values() if isinstance(value, dict) else value
    return max((_depth(item, level + 1) for item in items), default=level + 1)


def read_toml(path: Path, text: str | None = None, kind: str = "profile") -> tuple[dict[str, Any], str]:
    """Parse a TOML file (or ``text`` standing for it) into plain Python data.

    Returns:
        (data, the text it was parsed from).

    Raises:
        ProfileError: missing, a directory, not UTF-8, or malformed (with the line).
    """
    if text is None:
        text = _read_text(path, kind)
    try:
        # The standard library's parser reads a well-formed file several times faster than tomlkit (a release
        # reads about a dozen); tomlkit, which names the line of what it cannot read, says what is wrong.
        data = tomllib.loads(text)
        if _depth(data) <= TOML_DEPTH:
            return data, text
        decode_error = None  # as deep as tomlkit's bound, perhaps deeper: tomlkit decides
    except tomllib.TOMLDecodeError as err:
        decode_error = err
    except RecursionError:  # nested past Python's recursion limit, far beyond tomlkit's
        decode_error = None
    try:
        document = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as err:
        raise ProfileError(f"{path}:{err.line}: malformed TOML: {_parse_reason(err, text)}") from None
    except tomlkit.exceptions.TOMLKitError as err:
        # Semantic errors (a key or table defined twice) carry no line: find the key's first line.
        line = _line_of_repeated_key(text, str(err))
        raise ProfileError(f"{path}:{line}: malformed TOML: {err}" if line else f"{path}: malformed TOML: {err}") from None
    if decode_error is None:
        return document.unwrap(), text
    # What only the standard library refuses: its message, with the line it gives.
    found = re.search(r"\(at line (\d+), column \d+\)$", str(decode_error))
    reason = re.sub(r" \(at (?:line \d+, column \d+|end of document)\)$", "", str(decode_error))
    raise ProfileError(f"{path}:{found.group(1)}: malformed TOML: {reason}" if found
                       else f"{path}: malformed TOML: {reason}") from None


def _read_text(path: Path, kind: str = "profile") -> str:
    from ..common.files import Damaged, read_bytes

    try:
        data = read_bytes(path, allow_symlink=True)  # a fifo or a device is refused, never waited on
    except Damaged as err:
        raise ProfileError(f"{path}: {err.form}; give {'an' if kind[:1] in 'aeiou' else 'a'} {kind} file") from None
    if data is None:
        raise ProfileError(f"{path}: {kind} file not found; check the path or create it")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ProfileError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); TOML files are UTF-8") from None


def _line_of_repeated_key(text: str, message: str) -> int:
    match = re.search(r'[Kk]ey "([^"]+)"', message)
    if not match:
        return 0
    key = match.group(1).split(".")[-1]
    hits = [n for n, line in enumerate(text.splitlines(), 1) if re.match(rf"\s*{re.escape(key)}\s*=", line)]
    return hits[1] if len(hits) > 1 else (hits[0] if hits else 0)


def _parse_reason(err: tomlkit.exceptions.ParseError, text: str) -> str:
    # tomlkit's message ends with " at line L col C"; the line is already in front. At the end of the text its
    # reader sees "\0", which it names as if the file held one.
    reason = re.sub(r" at line \d+ col \d+$", "", str(err))
    if "'\\x00'" in reason and "\0" not in text:
        return "the file ends where a value or a key was expected (was it cut short?)"
    return reason


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _flatten_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        keys.append(dotted)
        if isinstance(value, dict):
            keys.extend(_flatten_keys(value, dotted))
    return keys


def load_document(
    path: Path, text: str | None = None
) -> tuple[dict[str, Any], list[Path], dict[str, tuple[Path, int]]]:
    """Read a profile and its ``extends`` chain and merge them, without validating.

    Args:
        path: the profile file.
        text: the profile's text, when it is not (yet) what the file holds.

    Returns:
        (merged data, chain of files leaf first, origins of each dotted key).

    Raises:
        ProfileError: a file is missing or malformed, ``extends`` is not a
            string, or the chain has a cycle.
    """
    chain: list[Path] = []
    layers: list[tuple[Path, dict[str, Any], str]] = []
    current = Path(path)
    while True:
        resolved = current.resolve()
        if resolved in [p.resolve() for p in chain]:
            cycle = " -> ".join(str(p) for p in [*chain, current])
            raise ProfileError(f"{chain[-1]}: extends: cycle of extends: {cycle}; remove one of the links")
        data, text = read_toml(current, text if not chain else None)
        chain.append(current)
        layers.append((current, data, text))
        parent = data.pop("extends", None)
        if parent is None:
            break
        if not isinstance(parent, str) or not parent:
            line = key_lines(text).get("extends", 0)
            raise ProfileError(f"{current}:{line}: extends: must be a file name string, got {spelled(parent)}")
        target = current.parent / parent
        if not os.path.lexists(target) or (os.path.islink(target) and not os.path.exists(target)):
            line = key_lines(text).get("extends", 0)
            raise ProfileError(
                f"{current}:{line}: extends: profile {target} not found; fix the name or create it"
            )
        current = target  # what is there, if no file, is named by its read (a FIFO is never opened)

    merged: dict[str, Any] = {}
    origins: dict[str, tuple[Path, int]] = {}
    for file, data, text in reversed(layers):
        merged = _merge(merged, data)
        lines = key_lines(text)
        for key in _flatten_keys(data):
            origins[key] = (file, lines.get(key, _nearest_line(lines, key)))
    return merged, chain, origins


def _nearest_line(lines: dict[str, int], key: str) -> int:
    parts = key.split(".")
    while parts:
        parts.pop()
        if ".".join(parts) in lines:
            return lines[".".join(parts)]
    return 0


def _where(loc: tuple[Any, ...], origins: dict[str, tuple[Path, int]], leaf: Path) -> tuple[str, str]:
    keys = [str(part) for part in loc if not isinstance(part, int)]
    key = dotted(loc)
    probe = list(keys)
    while probe:
        if ".".join(probe) in origins:
            file, line = origins[".".join(probe)]
            return (f"{file}:{line}" if line else str(file)), key
        probe.pop()
    return str(leaf), key


def validate(data: dict[str, Any], origins: dict[str, tuple[Path, int]], leaf: Path) -> Profile:
    """Validate merged profile data against :class:`Profile`.

    Raises:
        ProfileError: ``FILE:LINE: KEY: RULE, got VALUE`` for the first error,
            with a count of any further errors.
    """
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        errors = ordered(err)
        first = errors[0]
        loc = tuple(first["loc"])
        named = re.match(r"(?:Value error, )?([a-z_]+(?:\|[a-z_]+)*): ", first["msg"])
        if named and first["type"] == "value_error":
            # A rule across keys names the key it is about (or the keys, "a|b: ..."): point at that key's line,
            # the first of them written in the leaf file if any is (the one this profile changed).
            keys = named.group(1).split("|")
            in_leaf = [k for k in keys if origins.get(dotted((*loc, k)), (None, 0))[0] == leaf]
            loc = (*loc, (in_leaf or keys)[0])
            first = {**first, "msg": first["msg"].replace(f"{named.group(1)}: ", "", 1)}
        place, key = _where(loc, origins, leaf)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        prefix = f"{key}: " if key else ""
        raise ProfileError(f"{place}: {prefix}{rule(first, Profile)}{more}") from None


def load_profile(path: Path) -> LoadedProfile:
    """Load, merge (``extends``) and validate a profile.

    Args:
        path: the profile's TOML file.

    Returns:
        A :class:`LoadedProfile`.

    Raises:
        ProfileError: one line naming the file, the line where known, the key and the rule.
    """
    path = Path(path)
    data, chain, origins = load_document(path)
    profile = validate(data, origins, path)
    return LoadedProfile(profile=profile, path=path, chain=chain, data=data, origins=origins)
