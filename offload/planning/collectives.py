"""The collective half of the cost model (pure): how long a ring reduce-scatter, all-gather or all-reduce
of ``nbytes`` takes over ``N = G x M`` ranks (``G`` GPUs on each of ``M`` nodes), for data parallelism
(issue 20).

[Note: the alpha-beta ring model]
A ring collective over ``p`` ranks on a link of bandwidth ``B`` (bytes/s each rank sends, per direction)
and per-step latency ``a`` moves, for a buffer of ``S`` bytes (the *whole* buffer: the input of a
reduce-scatter, the output of an all-gather):

* reduce-scatter: ``p - 1`` steps of ``S / p`` bytes: ``(p - 1) a + (p - 1) / p * S / B``;
* all-gather: the same;
* all-reduce = reduce-scatter + all-gather: ``2 (p - 1) a + 2 (p - 1) / p * S / B``.

``p = 1`` costs nothing (no collective is issued). With ``M > 1`` nodes the collective is hierarchical,
as NCCL's tree/ring hybrids and FSDP's HSDP do: a reduce-scatter runs inside each node over its ``G``
ranks first (each rank then holds ``S / G`` partial sums), then across nodes among the ``M`` ranks of
the same local index on ``S / G`` bytes; an all-gather runs in the reverse order. The ``G`` inter-node
rings of a node run at once and share the node's network bandwidth ``B_net`` (all its NICs together), so
each gets ``B_net / G``; the inter-node term is ``(M - 1) a_net + (M - 1) / M * (S / G) / (B_net / G)
= (M - 1) a_net + (M - 1) / M * S / B_net``. In all::

    RS(S) = AG(S) = (G - 1) a_gpu + (G - 1) / G * S / B_gpu  +  (M - 1) a_net + (M - 1) / M * S / B_net

This is a MODEL, not a measurement: the presets below are nominal figures with their sources and
assumptions stated; ``offload probe`` is where measured figures would come from once a process group
exists (the runtime half of issue 20). Not modelled: NCCL's protocol choice (LL/LL128/Simple) and chunk
pipelining (the latency term stands for all of it), NVLink SHARP / in-network reduction, congestion from
other jobs, stragglers (every rank is assumed to do the same work at the same speed).

[Note: gloo's collectives]
What the runtime runs today (``offload/runtime/distributed.py``) is gloo on host tensors, and gloo is not
NCCL: read from PyTorch's ``ProcessGroupGloo.cpp`` and gloo's ``allreduce.cc`` / ``allgather.cc``:

* ``all_gather_into_tensor`` is gloo's ring all-gather over all ``p`` ranks, *flat* (no hierarchy: one ring
  through every rank, in rank order, so with ``M`` nodes of ``G`` consecutive ranks ``M`` of its ``p`` hops
  cross nodes): ``p - 1`` steps, each moving ``S / p`` bytes on every hop at once. PyTorch stages it
  through a flat output buffer, then copies each chunk into place.
* ``reduce_scatter_tensor`` is **not** a reduce-scatter: ProcessGroupGloo clones the whole input and runs an
  *all-reduce* of it (gloo's default ring: a ring reduce-scatter then a ring all-gather, each rank's chunk
  cut into >= 2 segments so a send overlaps a reduction), then copies the rank's ``S / p`` chunk out. So it
  moves twice a reduce-scatter's bytes: ``2 (p - 1)`` steps of ``S / p``.
* A ring step lasts as long as its slowest hop: ``a + (S / p) / B`` with ``(a, B)`` the hop's latency and
  per-stream bandwidth, the inter-node link's as soon as ``M > 1`` (:func:`gloo_step_seconds`). Each hop is
  one TCP stream, so a stream's rate, not the NIC's line rate, is what bounds it.

So ``AG(S) = (p - 1) (a + S / (p B))`` and ``RS(S) = AR(S) = 2 (p - 1) (a + S / (p B))``. Not modelled: the
CPU time of gloo's reductions and of the TCP stacks, which share the node's cores with the AdamW of the
``G`` ranks (folded into the nominal ``B``); TCP slow start and congestion. The presets
(:data:`GLOO_INTRA`, :data:`GLOO_INTER`) are NOMINAL figures, stated as such: not NCCL's NVLink or
InfiniBand figures, which gloo, a TCP transport, does not reach.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One level of the collective network, as the ring model sees it."""

    name: str
    bytes_per_s: float
    """Bandwidth a ring gets, per direction: per GPU inside a node, per *node* (all NICs) across nodes."""
    latency_s: float
    """Seconds per ring step beyond the bytes (launch, synchronisation, protocol)."""
    shares_host_link: bool = False
    """True when this traffic crosses the same PCIe link as the host copies (GPUs without NVLink): the
    simulator slows a collective that starts while a copy is running (see ``data_parallel.py``)."""
    source: str = ""
    """Where the figure comes from, and what is assumed."""

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"Link {self.name!r}: bytes_per_s must be positive; got {self.bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"Link {self.name!r}: latency_s must be >= 0; got {self.latency_s!r}")


GB = 1e9
_LINE = 0.9  # share of a NIC's line rate NCCL's bus bandwidth reaches on large messages (assumed, see below)

INTRA: dict[str, Link] = {
    "nvlink3": Link(
        "nvlink3", 230 * GB, 5e-6,
        source="A100 SXM, NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction per GPU (NVIDIA A100 datasheet); "
               "taken at 230 GB/s, about the all-reduce bus bandwidth nccl-tests reports on 8x A100 SXM; "
               "5 us per ring step assumed"),
    "nvlink4": Link(
        "nvlink4", 360 * GB, 5e-6,
        source="H100 SXM, NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA H100 datasheet); "
               "taken at 80 % of it, 360 GB/s (no NVLink SHARP); 5 us per ring step assumed"),
    "pcie4-p2p": Link(
        "pcie4-p2p", 20 * GB, 10e-6, shares_host_link=True,
        source="GPUs without NVLink, peer-to-peer over PCIe 4.0 x16 (~25 GB/s per direction, the pcie4 host "
               "preset's figure), taken at 20 GB/s for a ring through the PCIe switches; shares the host link "
               "with the offload copies; 10 us per ring step assumed"),
    "pcie5-p2p": Link(
        "pcie5-p2p", 40 * GB, 10e-6, shares_host_link=True,
        source="GPUs without NVLink, peer-to-peer over PCIe 5.0 x16 (~50 GB/s per direction, the pcie5 host "
               "preset's figure), taken at 40 GB/s; shares the host link with the offload copies; 10 us per "
               "ring step assumed"),
}
"""Inside one node. Bandwidth per GPU, per direction."""

INTER: dict[str, Link] = {
    "eth100": Link(
        "eth100", 100e9 / 8 * _LINE, 20e-6,
        source="one 100 Gb/s Ethernet (RoCE) NIC per node: 12.5 GB/s line rate x 0.9 (assumed bus-bandwidth "
               "efficiency); 20 us per ring step assumed"),
    "ib200": Link(
        "ib200", 200e9 / 8 * _LINE, 10e-6,
        source="one 200 Gb/s InfiniBand HDR NIC per node: 25 GB/s line rate x 0.9 (assumed); 10 us per ring "
               "step assumed"),
    "ib400": Link(
        "ib400", 400e9 / 8 * _LINE, 10e-6,
        source="one 400 Gb/s InfiniBand NDR NIC per node: 50 GB/s line rate x 0.9 (assumed); 10 us per ring "
               "step assumed"),
    "ib8x400": Link(
        "ib8x400", 8 * 400e9 / 8 * _LINE, 10e-6,
        source="eight 400 Gb/s NDR NICs per node, one per GPU (a DGX H100's compute fabric): 400 GB/s line "
               "rate x 0.9 (assumed); 10 us per ring step assumed"),
}
"""Across nodes. Bandwidth per *node* (all its NICs), per direction."""


@dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` ranks on each of ``nodes`` nodes, one rank per GPU, every node alike."""

    gpus_per_node: int = 1
    nodes: int = 1
    intra: Link = INTRA["nvlink3"]
    inter: Link = INTER["ib200"]

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Cluster.{name} must be an integer >= 1; got {v!r}")

    @property
    def world(self) -> int:
        """Ranks in all: ``gpus_per_node * nodes``."""
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        if self.world == 1:
            return "1 GPU"
        out = f"{self.world} GPUs ({self.nodes} x {self.gpus_per_node}, {self.intra.name}"
        return out + (f", {self.inter.name})" if self.nodes > 1 else ")")


def cluster_of(gpus: int, nodes: int = 1, intra: str | Link = "nvlink3", inter: str | Link = "ib200") -> Cluster:
    """``gpus`` ranks in all spread evenly over ``nodes`` nodes; links by preset name or as :class:`Link`."""
    if nodes < 1 or gpus < nodes or gpus % nodes:
        raise ValueError(f"{gpus} GPUs cannot be spread evenly over {nodes} nodes: give a multiple of the nodes")
    return Cluster(gpus // nodes, nodes, _link(INTRA, intra), _link(INTER, inter))


def _link(presets: dict[str, Link], spec: str | Link) -> Link:
    if isinstance(spec, Link):
        return spec
    if spec not in presets:
        raise ValueError(f"unknown link {spec!r}: use one of {sorted(presets)} or pass a Link")
    return presets[spec]


def ring_seconds(nbytes: int, ranks: int, link: Link) -> float:
    """One ring reduce-scatter (or all-gather) of a ``nbytes`` buffer over ``ranks`` ranks of ``link``:
    ``(p - 1) a + (p - 1) / p * S / B`` (see [Note: the alpha-beta ring model]); 0 for one rank or no bytes."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes / link.bytes_per_s


def inter_seconds(nbytes: int, cluster: Cluster) -> float:
    """The across-nodes part of a hierarchical reduce-scatter or all-gather of a ``nbytes`` buffer: the ``G``
    rings on ``nbytes / G`` each, sharing the node's network: ``(M - 1) a + (M - 1) / M * S / B_net``."""
    return ring_seconds(nbytes, cluster.nodes, cluster.inter)


def intra_seconds(nbytes: int, cluster: Cluster) -> float:
    """The inside-a-node part: a ring over the node's ``G`` GPUs on the whole ``nbytes``."""
    return ring_seconds(nbytes, cluster.gpus_per_node, cluster.intra)


def reduce_scatter_seconds(nbytes: int, cluster: Cluster) -> float:
    """A reduce-scatter of a ``nbytes`` buffer over every rank of ``cluster`` (intra-node, then inter-node)."""
    return intra_seconds(nbytes, cluster) + inter_seconds(nbytes, cluster)


def all_gather_seconds(nbytes: int, cluster: Cluster) -> float:
    """An all-gather into a ``nbytes`` buffer over every rank of ``cluster`` (inter-node, then intra-node)."""
    return inter_seconds(nbytes, cluster) + intra_seconds(nbytes, cluster)


def all_reduce_seconds(nbytes: int, cluster: Cluster) -> float:
    """An all-reduce of a ``nbytes`` buffer: a reduce-scatter then an all-gather."""
    return reduce_scatter_seconds(nbytes, cluster) + all_gather_seconds(nbytes, cluster)


# -- gloo, as the runtime runs its collectives today ------------------------------------------------------

GLOO_INTRA: dict[str, Link] = {
    "loopback": Link(
        "gloo-loopback", 3 * GB, 30e-6,
        source="NOMINAL, not measured: two processes on one host through gloo's TCP transport over loopback "
               "(PyTorch builds gloo with TCP; no shared-memory transport). Taken at 3 GB/s per ring hop (one "
               "TCP stream, which a server core drives at a few GB/s, plus gloo's copies) and 30 us per ring step "
               "(a loopback round trip plus gloo's per-segment synchronisation). benchmarks/scaling_cpu.py "
               "measures it on the machine it runs on (0.15-0.25 GB/s on a loaded 2-vCPU VM: far below)"),
}
"""gloo between the ranks of one node. Bandwidth per ring hop (one TCP stream), per direction."""

GLOO_INTER: dict[str, Link] = {
    "tcp-eth100": Link(
        "gloo-tcp-eth100", 5 * GB, 50e-6,
        source="NOMINAL: gloo's TCP transport over one 100 Gb/s Ethernet NIC: a ring hop is one TCP stream, "
               "taken at 5 GB/s (40 % of the 12.5 GB/s line rate: one untuned stream, no RDMA) and 50 us per "
               "ring step"),
    "ipoib-200": Link(
        "gloo-ipoib-200", 6 * GB, 40e-6,
        source="NOMINAL: gloo's TCP transport over IP-over-InfiniBand on a 200 Gb/s HDR NIC (gloo as PyTorch "
               "builds it has no verbs transport): one stream taken at 6 GB/s, 40 us per ring step"),
    "ipoib-400": Link(
        "gloo-ipoib-400", 8 * GB, 40e-6,
        source="NOMINAL: gloo's TCP transport over IP-over-InfiniBand on a 400 Gb/s NDR NIC: one stream taken "
               "at 8 GB/s (a TCP stream, not the link, is the limit), 40 us per ring step"),
}
"""gloo across nodes. Bandwidth per ring hop (one TCP stream between two ranks on different nodes)."""

GLOO_INTER_OF = {"eth100": "tcp-eth100", "ib200": "ipoib-200", "ib400": "ipoib-400", "ib8x400": "ipoib-400"}
"""The gloo preset over the NICs of each NCCL inter-node preset (several NICs do not help one flat ring's hop)."""


def gloo_cluster_of(gpus: int, nodes: int = 1, intra: str | Link = "loopback",
                    inter: str | Link = "tcp-eth100") -> Cluster:
    """The ranks of :func:`cluster_of` with gloo's links (see [Note: gloo's collectives])."""
    return cluster_of(gpus, nodes, _link(GLOO_INTRA, intra), _link(GLOO_INTER, inter))


def gloo_step_seconds(chunk: int, cluster: Cluster) -> float:
    """One step of gloo's flat ring over every rank of ``cluster``: every hop moves ``chunk`` bytes at once,
    and the step lasts as long as its slowest hop (an inter-node hop as soon as there are two nodes)."""
    hops = []
    if cluster.gpus_per_node > 1:
        hops.append(cluster.intra)
    if cluster.nodes > 1:
        hops.append(cluster.inter)
    return max(link.latency_s + chunk / link.bytes_per_s for link in hops)


def gloo_all_gather_seconds(nbytes: int, cluster: Cluster) -> float:
    """gloo's ring all-gather into a ``nbytes`` buffer: ``(p - 1)`` steps of ``S / p`` bytes on a flat ring."""
    p = cluster.world
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * gloo_step_seconds(-(-nbytes // p), cluster)


def gloo_all_reduce_seconds(nbytes: int, cluster: Cluster) -> float:
    """gloo's ring all-reduce of a ``nbytes`` buffer: a ring reduce-scatter then a ring all-gather."""
    return 2 * gloo_all_gather_seconds(nbytes, cluster)


def gloo_reduce_scatter_seconds(nbytes: int, cluster: Cluster) -> float:
    """``reduce_scatter_tensor`` of a ``nbytes`` buffer on a gloo group: ProcessGroupGloo implements it as an
    all-reduce of a clone of the whole buffer (then copies the rank's chunk out), so it costs an all-reduce's
    network time ([Note: gloo's collectives]; the copies are the caller's to charge)."""
    return gloo_all_reduce_seconds(nbytes, cluster)
