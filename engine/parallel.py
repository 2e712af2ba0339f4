"""The parallelism degrees of a run and its one `DeviceMesh`: `ParallelDims`.

Built once by `engine.initialize` (`ParallelDims.from_config(cfg, world_size=...)`, then
`build_mesh(device_type)`) and held as `engine.parallel`; everything that means "the data-parallel
ranks" asks it (`dp_group`, `dp_size`, `dp_rank`): the batch arithmetic, the data loader, every ZeRO
strategy (its `process_group=`, which is also the group gradient clipping reduces over), and the
checkpoint manifest, which records `degrees()`. Nothing calls `dist.get_world_size()` to mean the
data-parallel size.

Degrees, outermost first (the mesh's dimension order, as torchtitan orders them so that the innermost,
most communication-hungry axes get neighbouring ranks): `pp` pipeline stages, `dp_replicate` replicated
data parallelism (HSDP's outer axis), `dp_shard` sharded data parallelism (ZeRO's axis), `sp` sequence
parallelism (Ulysses), `tp` tensor parallelism. Their product is the world size; -1 on one of the two
data-parallel degrees means "the rest". `ep` (expert parallelism) is not a mesh axis of its own: as in
DeepSpeed, expert-parallel groups are carved out of the data-parallel ranks, so `ep` must divide
`dp_replicate * dp_shard`, and the `ep` sub-mesh is the flattened `dp` axis unflattened into
(`dp_mod_ep`, `ep`). MoE layers of one model may use several ep degrees (`ep_sizes`; `ep` is the
largest): each is its own unflattening of `dp`, with its own pair of sub-meshes.

The mesh is torch's `init_device_mesh` over all five axes, size-1 axes included (measured on gloo,
torch 2.13: building it at 2 and 3 ranks takes ~0.1 s; slicing a size-1 axis gives a one-rank group), so
`mesh["tp"]` exists whatever the degrees; the data-parallel sub-mesh is `_flatten("dp")` of
(`dp_replicate`, `dp_shard`), kept here because torch deprecates re-slicing a flattened axis from the
root mesh. Which config section sets which degree is `DEGREE_KEYS` (engine/config_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepfleet.engine.config_parallel import DEGREE_KEYS, OFF_VALUES

DIMS = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
"""The mesh's axes, outermost first."""


@dataclass
class ParallelDims:
    """Degrees of parallelism over `world_size` ranks (see the module docstring). Raises ValueError,
    naming the degree (or its config key) and the fix, when they cannot tile the world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    sp: int = 1
    tp: int = 1
    world_size: int = 1
    ep_sizes: tuple[int, ...] = ()
    """Every expert-parallel degree the model's MoE layers use, when they use several (DeepSpeed lets each
    layer pick its ep_size); `ep` is the largest. Empty: `ep` alone."""
    names: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """degree -> the config key that set it, for error messages."""

    def __post_init__(self) -> None:
        self._check()
        self.mesh: Any = None
        self._submeshes: dict[str, Any] = {}

    # -- arithmetic ------------------------------------------------------------------------------

    def _label(self, degree: str) -> str:
        return self.names.get(degree, degree)

    def _check(self) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"world_size: must be a positive integer, got {ws!r}")
        for degree in ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp"):
            value = getattr(self, degree)
            rest_ok = degree in ("dp_replicate", "dp_shard")
            if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or (rest_ok and value == -1)):
                allowed = "a positive integer or -1 (the rest)" if rest_ok else "a positive integer"
                raise ValueError(f"{self._label(degree)}: must be {allowed}, got {value!r}")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ValueError(
                f"{self._label('dp_replicate')}: -1 on both dp_replicate and dp_shard; "
                "give one of them a number (dp_replicate=1 for plain ZeRO)"
            )
        fixed = {d: getattr(self, d) for d in DIMS if getattr(self, d) != -1}
        product = math.prod(fixed.values())
        spelled = " * ".join(f"{d} {v}" for d, v in fixed.items())
        rest = next((d for d in DIMS if getattr(self, d) == -1), None)
        if rest is not None:
            if ws % product:
                raise ValueError(
                    f"{self._label(rest)}: -1 (the rest) needs the world size {ws} to be a multiple of "
                    f"{spelled} = {product}; run on a multiple of {product} ranks or lower those degrees"
                )
            setattr(self, rest, ws // product)
        elif product != ws:
            raise ValueError(
                f"{spelled} = {product} != world_size {ws}; the degrees must multiply to the world size "
                "(set dp_shard=-1 to give data parallelism the rest)"
            )
        for ep in sorted({self.ep, *self.ep_sizes}):
            if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
                raise ValueError(f"{self._label('ep')}: must be a positive integer, got {ep!r}")
            if self.dp_size % ep:
                raise ValueError(
                    f"{self._label('ep')}: {ep} does not divide the data-parallel size {self.dp_size} "
                    f"(dp_replicate {self.dp_replicate} * dp_shard {self.dp_shard}); expert-parallel groups "
                    f"are carved out of the data-parallel ranks, so use a divisor of {self.dp_size}"
                )
        self.ep_sizes = tuple(sorted({self.ep, *self.ep_sizes} - {1}))

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks (dp_replicate * dp_shard): what the batch is split over."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        """Every degree and the world size (what the checkpoint manifest records)."""
        return {d: getattr(self, d) for d in ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp", "world_size")}

    @classmethod
    def from_config(cls, cfg: Any, *, world_size: int, model_degrees: dict[str, tuple[int, str]] | None = None,
                    ep_sizes: tuple[int, ...] = ()) -> ParallelDims:
        """The degrees the config's sections ask for (`DEGREE_KEYS`); data parallelism takes the rest.
        `model_degrees` (degree -> (value, label)) are degrees the model itself asks for, e.g. its
        `MoE(ep_size=...)` layers; they win over an unset config key. `ep_sizes`: every ep degree of the
        model's layers when they use several. Raises ValueError naming the config key (or the label) when
        they cannot tile `world_size` ranks."""
        given: dict[str, int] = {}
        for degree, key in DEGREE_KEYS.items():
            value: Any = cfg
            for part in key.split("."):
                value = getattr(value, part, None) if value is not None else None
            if value is not None and not (degree in OFF_VALUES and value == OFF_VALUES[degree]):
                given[degree] = value
        names = {d: DEGREE_KEYS[d] for d in given}
        for degree, (value, label) in (model_degrees or {}).items():
            if degree not in given:
                given[degree], names[degree] = value, label
        return cls(**given, world_size=world_size, ep_sizes=tuple(ep_sizes), names=names)

    # -- the mesh --------------------------------------------------------------------------------

    def build_mesh(self, device_type: str = "cpu") -> Any:
        """Create the one DeviceMesh over all five axes (every rank must call it, once) and its named
        sub-meshes; returns the mesh. Needs the default process group."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.mesh is not None:
            return self.mesh
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in DIMS), mesh_dim_names=DIMS)
        subs = {d: mesh[d] for d in DIMS}
        subs["dp"] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.sp > 1:  # sequence-parallel ranks see other tokens of the same samples: gradients span both
            subs["dp_sp"] = mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")
        for ep in self.ep_sizes:  # one (dp_mod_ep, ep) split of the dp axis per expert-parallel degree
            names = ("dp_mod_ep", "ep") if ep == self.ep else (f"dp_mod_ep_size_{ep}", f"ep_size_{ep}")
            split = subs["dp"]._unflatten(0, (self.dp_size // ep, ep), names)
            subs[names[0]], subs[names[1]] = split[names[0]], split[names[1]]
        self.mesh, self._submeshes = mesh, subs
        return mesh

    def expert_submeshes(self, ep_size: int) -> tuple[Any, Any]:
        """(ep sub-mesh, expert-data-parallel sub-mesh) of the expert-parallel degree `ep_size` (> 1, one
        of `ep_sizes`): ranks exchanging tokens (consecutive dp ranks) and ranks holding the same experts."""
        if ep_size == self.ep:
            return self.submesh("ep"), self.submesh("dp_mod_ep")
        return self.submesh(f"ep_size_{ep_size}"), self.submesh(f"dp_mod_ep_size_{ep_size}")

    def submesh(self, name: str) -> Any:
        """A named sub-mesh: one of `DIMS`, "dp" (dp_replicate x dp_shard flattened), with sp > 1 "dp_sp"
        (dp x sp flattened), with ep > 1 "ep" and "dp_mod_ep", and for each other degree e of `ep_sizes`
        "ep_size_<e>" and "dp_mod_ep_size_<e>". Raises KeyError for other names, RuntimeError before `build_mesh`."""
        if self.mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not run; the engine builds it in initialize")
        if name not in self._submeshes:
            raise KeyError(f"no sub-mesh {name!r}; use one of {sorted(self._submeshes)}")
        return self._submeshes[name]

    @property
    def dp_mesh(self) -> Any:
        """The data-parallel sub-mesh (dp_replicate x dp_shard, flattened)."""
        return self.submesh("dp")

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group: what gradients reduce over and the batch is split over."""
        return self.dp_mesh.get_group()

    @property
    def grad_group(self) -> Any:
        """The group gradients are averaged (and ZeRO state sharded) over: the data-parallel ranks, and with
        sp > 1 the sequence-parallel ranks too (each holds 1/sp of every sequence's tokens), as DeepSpeed's
        sequence-data-parallel group."""
        return self.submesh("dp_sp").get_group() if self.sp > 1 else self.dp_group

    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group (the data loader's shard)."""
        return self.dp_mesh.get_local_rank()

