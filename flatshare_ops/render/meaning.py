"""Every rendered value keeps its meaning: read the render back as vLLM and systemd read it.

A profile value can be valid TOML of the right type and still mean something
else once it is a word on a command line or a unit line: ``served_model_name
= "--port"`` makes vLLM read ``--served-model-name`` without a value; a value
starting with ``-`` can be taken for a flag. Rather than guess each such case,
the render is read back: the engine's command line with the option table of
the profile's vLLM release (:mod:`common.vllm_argv`, which mirrors vLLM's
own parser), the units' command lines and environments as systemd reads them
(:mod:`common.unit_file`). Anything that does not read back as the profile's
value is refused at validation, naming the key (one line, exit 2).
"""

from __future__ import annotations

from ..common import unit_file, vllm_argv
from ..config.profile import LoadedProfile
from ..errors import ProfileError

#: vLLM's namespace name -> the profile key it comes from.
DEST_KEYS = {
    "model_tag": "engine.model",
    "served_model_name": "engine.served_model_name",
    "host": "engine.host",
    "port": "engine.port",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "max_model_len": "engine.max_model_len",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "kv_offloading_size": "engine.kv_offloading.size_gib",
    "kv_offloading_backend": "engine.kv_offloading.backend",
    "async_scheduling": "engine.async_scheduling",
    "enforce_eager": "engine.enforce_eager",
    "attention_backend": "engine.attention_backend",
    "scheduler_cls": "engine.scheduler_cls",
    "additional_config": "engine.make_room",
    "speculative_config": "engine.speculative",
    "override_generation_config": "engine.override_generation_config",
}


def expected_values(loaded: LoadedProfile) -> dict[str, object]:
    """What vLLM's namespace must hold for the profile's engine: dest -> value, typed as vLLM types it."""
    e = loaded.profile.engine
    values: dict[str, object] = {
        "served_model_name": [e.served_model_name], "host": e.host, "port": e.port,
        "gpu_memory_utilization": e.gpu_memory_utilization, "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_prefix_caching": e.enable_prefix_caching, "kv_cache_dtype": e.kv_cache_dtype,
        "async_scheduling": e.async_scheduling, "enforce_eager": e.enforce_eager, "attention_backend": e.attention_backend,
        "scheduler_cls": e.scheduler_cls,
        "additional_config": {"make_room": e.make_room.model_dump(), "flatshare_jit": e.flatshare_jit.model_dump()},
    }
    if e.kv_offloading.enabled:
        values["kv_offloading_size"] = e.kv_offloading.size_gib
        values["kv_offloading_backend"] = e.kv_offloading.backend
    speculative = getattr(e, "speculative", None)
    if speculative is not None and speculative.enabled:
        values["speculative_config"] = speculative.vllm_config()
    generation = e.override_generation_config.vllm_config()
    if generation:
        values["override_generation_config"] = generation
    return values


def _place(loaded: LoadedProfile, key: str) -> str:
    probe = key.split(".")
    while probe:
        found = loaded.origins.get(".".join(probe))
        if found:
            file, line = found
            return f"{file}:{line}" if line else str(file)
        probe.pop()
    return str(loaded.path)


def _key_in(message: str, release: str, loaded: LoadedProfile) -> str:
    if loaded.profile.engine.model.startswith("-") or "positional argument" in message:
        return "engine.model"
    for dest, key in DEST_KEYS.items():
        if dest != "model_tag" and vllm_argv.flag_name(dest, release) in message:
            return key
    return "engine"


def check_engine(loaded: LoadedProfile, argv: list[str]) -> None:
    """The engine's rendered command line reads back, as the profile's vLLM release reads it, as the profile says.

    Raises:
        ProfileError: vLLM would reject it, or read a value differently (names the key).
    """
    release = loaded.profile.engine.vllm_release
    if release not in vllm_argv.known_releases():
        return  # no option table: the preflight on the node parses it with vLLM itself
    reading = vllm_argv.read_argv(argv, release)
    if reading.errors:
        key = _key_in(reading.errors[0], release, loaded)
        raise ProfileError(f"{_place(loaded, key)}: {key}: vLLM {release} would reject the engine's command line "
                           f"({reading.errors[0]}); use a value vLLM reads as written")
    if reading.model != loaded.profile.engine.model:
        raise ProfileError(f"{_place(loaded, 'engine.model')}: engine.model: vLLM {release} would read "
                           f"{loaded.profile.engine.model!r} as {reading.model!r}")
    for dest, want in expected_values(loaded).items():
        got = reading.values.get(dest)
        if not vllm_argv._same(got, want):  # noqa: SLF001 (one definition of "same by meaning")
            key = DEST_KEYS[dest]
            raise ProfileError(f"{_place(loaded, key)}: {key}: vLLM {release} would read "
                               f"{vllm_argv.show(want)} as {vllm_argv.show(got)}")


def check_units(loaded: LoadedProfile, units: dict[str, str], commands: dict[tuple[str, str], list[str]]) -> None:
    """Each rendered command reads back, as systemd reads the unit, as the argv the profile says.

    Args:
        units: unit name -> text.
        commands: (unit name, key such as ``ExecStart``) -> the one argv that line must run.

    Raises:
        ProfileError: systemd would run something else (a value does not survive unit quoting).
    """
    for (name, key), expected in commands.items():
        try:
            lines = unit_file.meaning(units[name]).get(("Service", key), ())
        except unit_file.UnitSyntaxError as err:
            raise ProfileError(f"{loaded.path}: {name}: systemd would not read the rendered unit: {err}") from None
        runs = [list(argv) for line in lines for _prefix, argv in line]
        if runs != [list(expected)]:
            raise ProfileError(f"{loaded.path}: {name}: {key}= would run {runs} instead of {[list(expected)]}; "
                               "a profile value does not survive unit quoting")
