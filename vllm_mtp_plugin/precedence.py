"""Which class serves each MTP architecture when a platform plugin registers the same names.

vLLM loads ``vllm.general_plugins`` entry points in discovery order (``sys.path``, then the directory
listing order inside site-packages; ``VLLM_PLUGINS`` only filters by name), and
``ModelRegistry.register_model`` lets the last call win without a word. vllm-ascend registers its
own ``DeepSeekMTPModel``/``DeepseekV32MTPModel``/``DeepSeekV4MTPModel`` that way
(``vllm_ascend/models/__init__.py``), so which drafter served used to depend on the file system.

The rule here does not depend on the order:

* ``MTP_PLUGIN=auto`` (default): this plugin's class for every architecture it can build on
  the platform at hand; for the others (today: DeepSeek-V4 on a platform that names no V4 decoder
  block, ``platform.v4_block_missing``) the class a platform plugin registered, else vLLM's own,
  with one warning line per process.
* ``MTP_PLUGIN=on``: this plugin's class for every architecture.
* ``MTP_PLUGIN=off``: none of this plugin's classes (its fixes to vLLM still apply).
* The variable is not named ``VLLM_*``: vLLM warns about unknown ``VLLM_*`` variables and refuses
  them with ``--fail-on-environ-validation`` (``Platform.validate_environ``).
* vLLM's ``--model-class-overrides`` and any ``ModelRegistry.register_model`` call made outside
  plugin loading pass through untouched: an explicit choice wins over this rule.
"""

from __future__ import annotations

import logging
import os
import sys

MODE_VARIABLE = "MTP_PLUGIN"
MODES = ("auto", "on", "off")

logger = logging.getLogger("vllm.vllm_mtp_plugin")

# Architecture -> "module:Class" this plugin keeps while vLLM loads the other general plugins.
claimed: dict[str, str] = {}
# Architecture -> what another plugin registered for it ("module:Class"), before or after us.
others: dict[str, str] = {}
_vllm_register_model = None
_warned: set[str] = set()
# Where vLLM runs the general plugins: the guard below acts while this function is on the stack.
PLUGIN_LOADER = ("vllm.plugins", "load_general_plugins")
_plugin_loader_code = None


def mode() -> str:
    """``MTP_PLUGIN`` (auto, on, off); anything else is reported once and read as auto."""
    value = os.environ.get(MODE_VARIABLE, "auto").strip().lower() or "auto"
    if value not in MODES:
        if "mode" not in _warned:
            _warned.add("mode")
            logger.warning("vllm-mtp-plugin: %s=%r is not one of %s; using auto.", MODE_VARIABLE,
                           value, ", ".join(MODES))
        return "auto"
    return value


def unsupported_reason(arch: str) -> str | None:
    """Why this plugin's class for ``arch`` cannot run on this platform, or ``None``."""
    if arch == "DeepSeekV4MTPModel":
        from .platform import v4_block_missing

        return v4_block_missing()
    return None


def qualname(model_cls) -> str:
    if isinstance(model_cls, str):
        return model_cls
    return f"{getattr(model_cls, '__module__', '?')}:{getattr(model_cls, '__qualname__', model_cls)}"


def registered_qualname(registry, arch: str) -> str | None:
    """``module:Class`` of the registry's current entry for ``arch`` (lazy or imported)."""
    entry = registry.models.get(arch)
    if entry is None:
        return None
    if hasattr(entry, "module_name"):
        return f"{entry.module_name}:{entry.class_name}"
    return qualname(getattr(entry, "model_cls", entry))


def in_tree_qualname(arch: str) -> str | None:
    """``module:Class`` of vLLM's own entry for ``arch``, from its private model table; None (and
    one warning) where that table is not found, so a rename in vLLM costs only the restore of
    vLLM's class after ``MTP_PLUGIN=off`` in a process that had registered ours."""
    from vllm.model_executor.models import registry

    try:
        known = registry._VLLM_MODELS.get(arch)
        return f"{registry._resolve_module_name(known[0])}:{known[1]}" if known else None
    except (AttributeError, TypeError, IndexError) as exc:
        if "in-tree table" not in _warned:
            _warned.add("in-tree table")
            logger.warning("vllm-mtp-plugin: vLLM's model table (registry._VLLM_MODELS, "
                           "_resolve_module_name) not found (%s: %s); vLLM's own MTP classes are "
                           "not recognised by name.", type(exc).__name__, exc)
        return None


def apply(architectures: dict[str, str]) -> dict[str, str]:
    """Register ours where the rule says so; returns ``arch -> "ours" | "left: <reason>"``."""
    from vllm import ModelRegistry

    chosen = mode()
    outcome = {}
    left: dict[str, list[str]] = {}  # reason -> architectures, one warning line per reason
    for arch, target in architectures.items():
        current = registered_qualname(ModelRegistry, arch)
        if current not in (None, target, in_tree_qualname(arch)):
            others.setdefault(arch, current)  # a plugin discovered before this one
        reason = ("MTP_PLUGIN=off" if chosen == "off"
                  else None if chosen == "on" else unsupported_reason(arch))
        if reason is None:
            claimed[arch] = target
            _vllm_register(ModelRegistry)(arch, target)
            outcome[arch] = "ours"
            continue
        claimed.pop(arch, None)
        restore = others.get(arch) or in_tree_qualname(arch)
        if current == target and restore:  # registered by an earlier call in this process
            _vllm_register(ModelRegistry)(arch, restore)
        outcome[arch] = f"left: {reason}"
        if arch not in _warned:
            _warned.add(arch)
            left.setdefault(reason, []).append(arch)
    for reason, archs in left.items():
        logger.warning(
            "vllm-mtp-plugin: %s %s served by the platform plugin's class, or vLLM's own where "
            "none registers one, not by vllm-mtp-plugin (%s). Set %s=on to use ours anyway.",
            ", ".join(archs), "is" if len(archs) == 1 else "are", reason, MODE_VARIABLE)
    if claimed:
        keep_claimed_architectures(ModelRegistry)
    return outcome


def _vllm_register(registry):
    """The ``register_model`` the guard below wraps (vLLM's own), or the current one."""
    current = registry.register_model
    return _vllm_register_model if current is register_model else current


def keep_claimed_architectures(registry) -> None:
    """Keep this plugin's claimed architectures when another general plugin registers them later.

    What it fixes: the last ``register_model`` call wins, and plugins load in file-system order,
    so a platform plugin discovered after this one (vllm-ascend 0.30 registers all three DeepSeek
    MTP names) silently replaced our drafters. How to see it: install vllm-ascend and this plugin
    and compare ``ModelRegistry.models["DeepSeekMTPModel"]`` with ``MTP_PLUGIN`` unset across
    installs (``tests/engine/plugin/test_precedence.py`` does it with a test-only rival plugin in
    both orders).
    What it does: while vLLM runs ``load_general_plugins``, a registration of a claimed name is
    recorded in ``others`` and dropped; every other call (other names, ``--model-class-overrides``,
    user code) goes to vLLM unchanged. Where that function is not found (``_plugin_loader``), the
    guard is not installed and says so once. When it can go: when vLLM orders plugins or lets a
    model plugin declare precedence.
    """
    global _vllm_register_model, _plugin_loader_code
    _plugin_loader_code = _plugin_loader_code or _plugin_loader()
    if _plugin_loader_code is None:
        return
    if registry.register_model is not register_model:
        _vllm_register_model = registry.register_model
        registry.register_model = register_model


def register_model(model_arch, model_cls) -> None:
    """``ModelRegistry.register_model`` that keeps claimed names during plugin loading."""
    if model_arch in claimed and _loading_general_plugins():
        others[model_arch] = qualname(model_cls)
        logger.warning("vllm-mtp-plugin serves %s; %s, registered by another plugin, is not used "
                       "(set %s=off to use it)", model_arch, others[model_arch], MODE_VARIABLE)
        return
    _vllm_register_model(model_arch, model_cls)


def _plugin_loader():
    """The code object of vLLM's ``vllm.plugins.load_general_plugins``, or ``None`` (and one
    warning) where vLLM has renamed or moved it: the guard could then never tell plugin loading
    from any other registration."""
    import importlib
    import inspect

    module_name, function_name = PLUGIN_LOADER
    try:
        function = getattr(importlib.import_module(module_name), function_name, None)
        missing = None if function is not None else f"{module_name}.{function_name}"
    except ImportError as exc:
        function, missing = None, f"module {module_name} ({type(exc).__name__}: {exc})"
    code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
    if code is None and missing is None:
        missing = f"the code of {module_name}.{function_name} (it is {function!r})"
    if missing and "plugin loader" not in _warned:
        _warned.add("plugin loader")
        logger.warning(
            "vllm-mtp-plugin: vLLM's plugin loader %s not found; the guard that keeps this "
            "plugin's MTP architectures when another general plugin registers the same names "
            "later is not installed: whichever plugin vLLM loads last serves them (set %s=off to "
            "leave them to the other plugin, or uninstall one of the two).", missing,
            MODE_VARIABLE)
    return code


def _loading_general_plugins() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _plugin_loader_code:
            return True
        frame = frame.f_back
    return False
