"""The component registry: the one list every layer, CLI verb, report and test derives from.

A *component* is one pool or policy of an engine that kvproof checks with three
oracles (habit 2: the component is the unit). It has one name (:class:`Component`),
used as

* the spec module ``kvproof.spec.<name>`` (Z3 transitions and obligations, whose
  names start with ``<name>.``),
* the reference module ``kvproof.reference.<name>`` (pure operations),
* the runtime module ``kvproof.gpu_runtime.<name>`` (torch),
* the lockstep suite ``kvproof.conformance.<name>`` and its mutants
  ``kvproof.conformance.mutants.<name>``,
* the test files ``tests/<layer>/test_<name>.py``, the CLI's ``--component`` choice,
  the benchmark section and every test id (``<name>/<config>``).

Those locations follow from the name (:meth:`ComponentInfo.module`); a layer a
component deliberately lacks is declared here with the reason
(:attr:`ComponentInfo.absent`), and ``tests/test_registry.py`` fails for any other
gap. An implementation declares the components it serves as a set of
:class:`Component` values (``components``), never free strings.

Every layer above the reference uses it; ``kvproof.spec``, a leaf that imports nothing of
kvproof's, is checked against it by ``tests/test_registry.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvproof.reference.errors import ConfigError

__all__ = ["REGISTRY", "Component", "ComponentInfo", "Layer", "Option", "UnknownComponent", "info", "options",
           "parse_components"]


class Component(enum.StrEnum):
    """The components kvproof models, in the order every layer, CLI and report lists them."""

    SWA_ALLOCATOR = "swa_allocator"
    LOC_CACHE = "loc_cache"
    DECODE_PREALLOC = "decode_prealloc"
    HISPARSE_HOST = "hisparse_host"
    ADMISSION = "admission"
    TP_PREFETCH = "tp_prefetch"
    BLOCK_POOL = "block_pool"


class Layer(enum.StrEnum):
    """Where a component has a module; the value is the package below ``kvproof``."""

    SPEC = "spec"
    REFERENCE = "reference"
    RUNTIME = "gpu_runtime"
    SUITE = "conformance"
    MUTANTS = "conformance.mutants"


class UnknownComponent(ConfigError):
    """A component name that is not in the registry; the message lists the choices."""

    def __init__(self, name: object) -> None:
        self.name = name
        super().__init__("run", "component", f"unknown component {name!r}; choose one of "
                         f"{[c.value for c in Component]}")


@dataclass(frozen=True)
class Option:
    """A per-component option of a conformance run (``kvproof conform --policy``, ``--kvproof-policy``).

    Declared here, so the command line and the pytest plugin offer it without importing the
    suites; the component's suite turns a chosen value into its machine's options.
    """

    name: str
    choices: tuple[str, ...]
    default: str
    help: str


@dataclass(frozen=True)
class ComponentInfo:
    """One registry entry: what the component is, where its semantics are written, how it is served."""

    component: Component
    title: str
    #: where its semantics are written: sections of ../shared/research/sglang_semantics.md (SGLang components), or
    #: of a document of kvproof's own (``docs/block_pool.md`` for vLLM's manager)
    semantics: str
    #: the implementation its suite runs against by default (``module:factory``: kvproof's torch runtime)
    default_impl: str
    #: layers the component has no module in, each with the reason (every other layer must exist)
    absent: Mapping[Layer, str] = field(default_factory=dict)
    #: options of its conformance runs (the suite maps each value to machine options)
    options: tuple[Option, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "absent", MappingProxyType(dict(self.absent)))

    @property
    def name(self) -> str:
        return self.component.value

    def module(self, layer: Layer) -> str:
        """The dotted module of this component in ``layer`` (whether it exists is the completeness test's job)."""
        return f"kvproof.{layer.value}.{self.name}"

    def has(self, layer: Layer) -> bool:
        return layer not in self.absent


#: One entry per component, in :class:`Component` order.
REGISTRY: Mapping[Component, ComponentInfo] = MappingProxyType({entry.component: entry for entry in (
    ComponentInfo(
        Component.SWA_ALLOCATOR,
        "the paged full + SWA composite allocator: the full->SWA mapping, tail preallocation, CPU copies",
        "§1.2-§1.6, §2.7, §2.8, §7 G1-G5 M1-M5, §9 S3 S4",
        "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator",
    ),
    ComponentInfo(
        Component.LOC_CACHE,
        "the full->SWA loc translation cache (#25824/#26152), its invalidation points, CUDA-graph capture/replay",
        "§3, §7 C1-C4, §9 S5 S6",
        "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator",
    ),
    ComponentInfo(
        Component.DECODE_PREALLOC,
        "PD decode preallocation: admission budgets and gates (#24857), decode, retraction, resumption",
        "§2, §7 D1-D3, §9 S2",
        "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator",
        absent={Layer.RUNTIME: "the decode node is scheduler logic, not a pool: its suite replays the reference "
                               "scheduler's allocator calls on the swa_allocator runtime (or any allocator)"},
        options=(Option("policy", ("corrected", "upstream"), "corrected",
                        "decode_prealloc: the scheduler's admission policy (upstream crashes: S2)"),),
    ),
    ComponentInfo(
        Component.HISPARSE_HOST,
        "the paged HiSparse host pool of #23606: request table, staging, eager backup, release",
        "§4, §4.6 H0-H4, §9 S7",
        "kvproof.gpu_runtime.hisparse_host:HiSparseHostPool",
    ),
    ComponentInfo(
        Component.ADMISSION,
        "the prefill adder's SWA budget against HiCache load-back (#27391): S8's out-of-memory, S9's starvation",
        "§5, §7 A1-A3, §8 item 8, §9 S8 S9",
        "kvproof.gpu_runtime.admission:AdmissionRuntime",
        options=(Option("budget", ("pre_27391", "upstream_27391", "upstream_0523", "corrected"), "corrected",
                        "admission: the prefill adder's SWA budget (pre_27391 runs out: S8; upstream_27391 starves: "
                        "S9)"),),
    ),
    ComponentInfo(
        Component.TP_PREFETCH,
        "cross-rank sidecar hit sync and all-or-nothing SWA prefetch under tensor parallelism (#27264): S10",
        "§6, §7 T1-T5, §8 item 9, §9 S10",
        # N rank processes over a real torch.distributed group (gloo on loopback), started by the runtime itself
        "kvproof.gpu_runtime.tp_prefetch:TPPrefetchRuntime",
        options=(Option("variant", ("upstream_0523", "pre_27264", "upstream_27264", "sum_hits", "best_effort_release"),
                        "upstream_0523", "tp_prefetch: the cross-rank protocol (pre_27264 attaches different windows: "
                        "S10; sum_hits: R5-c; best_effort_release: R5-d)"),
                 Option("ranks", ("agree", "mixed", "host_pressure"), "agree",
                        "tp_prefetch: whether ranks share their termination policy, transfer set and registration "
                        "(mixed: T5's mismatched collectives, T1) and, under 0.5.23, their free host memory at hit "
                        "time (host_pressure: only that differs: F6)")),
    ),
    ComponentInfo(
        Component.BLOCK_POOL,
        "vLLM 0.33.0's v1 KV cache manager: block pool with a null block, prefix cache, full + sliding-window groups "
        "allocated all or nothing",
        "docs/block_pool.md §1-§7 (V1-V8)",
        "kvproof.gpu_runtime.block_pool:BlockPoolRuntime",
    ),
)})


def info(component: Component | str) -> ComponentInfo:
    """The registry entry of ``component`` (a :class:`Component` or its name); :class:`UnknownComponent` otherwise."""
    try:
        return REGISTRY[Component(component)]
    except ValueError:
        raise UnknownComponent(component) from None


def options() -> tuple[Option, ...]:
    """Every component's run options, once each by name, in registry order.

    Components may share an option name (none does today: ``decode_prealloc`` has ``--policy``, ``admission``
    ``--budget``, so that one component's value never stops another's run): the command line
    offers the union of their choices and each component's suite accepts only its own (a value another component
    does not know is a usage error when that component runs). Shared options must share their default.
    """
    seen: dict[str, Option] = {}
    for entry in REGISTRY.values():
        for option in entry.options:
            known = seen.get(option.name)
            if known is None:
                seen[option.name] = option
                continue
            if known.default != option.default:
                raise ConfigError("registry", option.name, f"components sharing option {option.name!r} must share "
                                  f"its default: {known.default!r} vs {option.default!r}")
            seen[option.name] = Option(option.name, tuple(dict.fromkeys(known.choices + option.choices)),
                                       known.default, f"{known.help}; {option.help}")
    return tuple(seen.values())


def parse_components(names: Iterable[Component | str]) -> tuple[Component, ...]:
    """Names as components, in registry order, without duplicates; :class:`UnknownComponent` for a bad one."""
    wanted = {info(name).component for name in names}
    return tuple(c for c in Component if c in wanted)
