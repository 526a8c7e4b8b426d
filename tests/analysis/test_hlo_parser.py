"""The HLO reader (`jaxpar.analysis.program.hlo`): hand-written HLO with known answers, then real compiled
programs whose collectives are known from how they were written (positive controls)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.program import hlo
from jaxpar.analysis.program.hlo_flops import matmul_flops

# ---- replica group spellings -----------------------------------------------------------------------


def test_iota_groups_plain_and_transposed():
    assert hlo.iota_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.iota_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    # Three dims: iota(8) as [2,2,2], swap the last two, rows of 2.
    assert hlo.iota_groups("[4,2]<=[2,2,2]T(0,2,1)") == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_explicit_and_empty_groups():
    assert hlo.parse_replica_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert hlo.parse_replica_groups("{}") is None


@pytest.mark.parametrize(
    "mesh_form, iota_form",
    [
        ("mesh['a'=2,'b'=4] {'b'}", "[2,4]<=[8]"),
        ("mesh['a'=2,'b'=4] {'a'}", "[4,2]<=[2,4]T(1,0)"),
        ("mesh['a'=2,'b'=4] {'a','b'}", "[1,8]<=[8]"),
        # A non-iota device order: the mesh's devices are iota(8) as [2,4] transposed, i.e.
        # a-major rows (0,4), (1,5), (2,6), (3,7): along `a` they run 0,1,2,3 and 4,5,6,7.
        ("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", "[2,4]<=[8]"),
        ("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}", "[4,2]<=[2,4]T(1,0)"),
        # Sub-axis b:(2)2 of b=4: b = 2 (major) x 2 (minor), group over the minor half.
        ("mesh['a'=2,'b'=4] {'b':(2)2}", "[4,2]<=[8]"),
        ("mesh['a'=2,'b'=4] {'b':(1)2}", "[4,2]<=[2,2,2]T(0,2,1)"),
    ],
)
def test_mesh_axes_groups_match_the_iota_form(mesh_form, iota_form):
    assert sorted(hlo.mesh_axes_groups(mesh_form)) == sorted(hlo.iota_groups(iota_form))


def test_mesh_axes_with_explicit_device_ids():
    groups = hlo.mesh_axes_groups("mesh['x'=2,'y'=2], device_ids=(3,1,2,0) {'y'}")
    assert groups == ((3, 1), (2, 0))


# ---- a whole module: loops, branches, async pairs, bytes --------------------------------------------

MODULE = """
HloModule test, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %v = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ar = f32[8,16]{1,0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar)
}

%inner_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %w = (s32[], f32[8,16]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %g = f32[8,16]{1,0} get-tuple-element(%w), index=1
  %ag = f32[8,64]{1,0} all-gather(%g), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true, \
metadata={op_name="jit(f)/cond/branch_1/all_gather"}
  %j = s32[] get-tuple-element(%w), index=0
  %s = f32[8,16]{1,0} slice(%ag), slice={[0:8], [0:16]}
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%j, %s)
}

%unknown_body (u: (s32[], bf16[4,4])) -> (s32[], bf16[4,4]) {
  %u = (s32[], bf16[4,4]{1,0}) parameter(0)
  %b = bf16[4,4]{1,0} get-tuple-element(%u), index=1
  %rs = bf16[1,4]{1,0} reduce-scatter(%b), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, \
dimensions={0}, use_global_device_ids=true, to_apply=%add
  %k = s32[] get-tuple-element(%u), index=0
  ROOT %o = (s32[], bf16[4,4]{1,0}) tuple(%k, %b)
}

%branch_a (a: f32[32]) -> f32[32] {
  %a = f32[32]{0} parameter(0)
  ROOT %perm = f32[32]{0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,0},{4,5},{5,4}}
}

%branch_b (b: f32[32]) -> f32[32] {
  ROOT %b = f32[32]{0} parameter(0)
}

%true_branch (tb: f32[32]) -> f32[32] {
  %tb = f32[32]{0} parameter(0)
  ROOT %a2a = f32[32]{0} all-to-all(%tb), channel_id=5, replica_groups={}, dimensions={0}
}

ENTRY %main (x0: f32[8,16], y0: bf16[4,4], z0: f32[32], idx: s32[], flag: pred[]) -> f32[] {
  %x0 = f32[8,16]{1,0} parameter(0)
  %y0 = bf16[4,4]{1,0} parameter(1)
  %z0 = f32[32]{0} parameter(2)
  %idx = s32[] parameter(3)
  %flag = pred[] parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x0)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %init2 = (s32[], bf16[4,4]{1,0}) tuple(%zero, %y0)
  %loop2 = (s32[], bf16[4,4]{1,0}) while(%init2), condition=%inner_cond, body=%unknown_body
  %sw = f32[32]{0} conditional(%idx, %z0, %z0), branch_computations={%branch_a, %branch_b}
  %ite = f32[32]{0} conditional(%flag, %z0, %z0), true_computation=%true_branch, false_computation=%branch_b
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%z0), channel_id=6, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %ars = f32[32]{0} all-reduce-start(%z0), channel_id=7, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ard = f32[32]{0} all-reduce-done(%ars)
  ROOT %out = f32[] constant(0)
}
"""


@pytest.fixture(scope="module")
def found():
    return {c.name: c for c in hlo.collectives(MODULE)}


def test_finds_every_collective_once(found):
    assert set(found) == {"ar", "ag", "rs", "perm", "a2a", "ags", "ars"}
    assert found["ags"].is_async and found["ars"].is_async and not found["ar"].is_async


def test_nested_loops_multiply_trip_counts(found):
    ar, ag = found["ar"], found["ag"]
    assert ar.trip_counts == (5, 3) and ar.loop_depth == 2 and ar.executions == 15 and ar.trip_counts_known
    assert ag.trip_counts == (5,) and ag.executions == 5


def test_unknown_trip_count_counts_once_and_says_so(found):
    rs = found["rs"]
    assert rs.loop_depth == 1 and rs.executions == 1 and not rs.trip_counts_known


def test_branches_are_read_from_conditionals_not_metadata(found):
    assert found["perm"].in_branch  # branch_computations={...}
    assert found["a2a"].in_branch  # true_computation=
    # Its op_name says "cond/branch_1", but it sits in a while body, not in a branch computation.
    assert not found["ag"].in_branch
    assert not found["ar"].in_branch


def test_shapes_bytes_and_groups(found):
    ar, ag, rs = found["ar"], found["ag"], found["rs"]
    assert ar.results == (hlo.Tensor("f32", (8, 16)),) and ar.size_bytes() == 8 * 16 * 4
    assert ar.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and ar.group_size() == 4
    assert ag.dimensions == (1,) and ag.size_bytes() == 8 * 64 * 4  # the gathered result
    assert ag.operands == (hlo.Tensor("f32", (8, 16)),)
    # reduce-scatter: the operand before scattering; bf16 is 2 bytes; groups from the mesh form.
    assert rs.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rs.size_bytes() == 1 * 4 * 2 * 4 and rs.operands == (hlo.Tensor("bf16", (4, 4)),)
    assert found["a2a"].groups is None and found["a2a"].group_size(8) == 8
    assert found["perm"].pairs == ((0, 1), (1, 0), (4, 5), (5, 4))


def test_async_results_come_from_the_done(found):
    assert found["ags"].results == (hlo.Tensor("f32", (16,)),)
    assert found["ars"].results == (hlo.Tensor("f32", (32,)),)
    assert found["ars"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))


class FakeMesh:
    """What `mesh_axes_of` reads from a jax Mesh: axis names and the device array's shape."""

    def __init__(self, **sizes):
        self.axis_names = tuple(sizes)
        self.devices = np.zeros(tuple(sizes.values()))


def test_groups_map_to_mesh_axes(found):
    mesh = FakeMesh(data=2, tensor=4)
    assert hlo.mesh_axes_of(found["ar"], mesh) == ("tensor",)
    assert hlo.mesh_axes_of(found["ars"], mesh) == ("data",)
    assert hlo.mesh_axes_of(found["a2a"], mesh) == ("data", "tensor")
    assert hlo.mesh_axes_of(found["perm"], mesh) == ("tensor",)
    other = FakeMesh(data=2, pipeline=2, tensor=2)
    # {0,1,2,3}: pipeline and tensor vary, data does not.
    assert hlo.mesh_axes_of(found["ar"], other) == ("pipeline", "tensor")
    assert hlo.spans_whole_axes(found["ar"], other)
    assert not hlo.spans_whole_axes(found["ars"], FakeMesh(data=4, tensor=2))  # {0,4} ⊂ data=4


def test_matmul_flops_apply_trip_counts():
    text = """
%body (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %a = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %b = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %d = f32[4,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%i, %a, %b)
}

%cond (c: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  ROOT %yes = pred[] constant(true)
}

%fused (x: f32[4,8], y: f32[8,16]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  ROOT %dot = f32[4,16]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: (s32[], f32[4,8], f32[8,16])) -> f32[] {
  %x = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %w = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %z = f32[] constant(0)
}
"""
    flops, upper = matmul_flops(text)
    assert flops == 2 * 4 * 16 * 8 * 7  # 2 · result elements · contracted size · trips
    assert not upper


def test_instructions_by_name_with_opcode_and_op_name():
    """Every instruction of every computation, a tuple-shaped result's opcode read past the
    nested tuple, and the metadata's op_name (what the profile maps to scopes)."""
    text = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%body (t: (s32[], (f32[4], f32[4]))) -> (s32[], (f32[4], f32[4])) {
  %t = (s32[], (f32[4]{0}, f32[4]{0})) parameter(0)
  ROOT %tuple.1 = (s32[], (f32[4]{0}, /*index=1*/f32[4]{0})) tuple(%t), metadata={op_name="jit(f)/while/body/attention/add"}
}

ENTRY %main.5 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %while.4 = (s32[], (f32[4]{0}, f32[4]{0})) while((s32[], (f32[4]{0}, f32[4]{0})) %t), condition=%c, body=%body, \
metadata={op_name="jit(f)/while"}
  ROOT %ynn_fusion.2 = f32[4]{0} fusion(%p), kind=kCustom, calls=%f, \
metadata={op_name="jit(f)/transpose(jvp(mlp))/dot_general" stack_frame_id=3}
}"""
    found = hlo.instructions(text)
    assert hlo.module_name(text) == "jit_f" and hlo.module_name("no module line") == ""
    assert sorted(found) == ["p", "t", "tuple.1", "while.4", "ynn_fusion.2"]
    assert (found["while.4"].opcode, found["while.4"].op_name) == ("while", "jit(f)/while")
    assert (found["tuple.1"].opcode, found["tuple.1"].op_name) == ("tuple", "jit(f)/while/body/attention/add")
    assert found["ynn_fusion.2"].opcode == "fusion"
    assert found["ynn_fusion.2"].op_name == "jit(f)/transpose(jvp(mlp))/dot_general"
    assert found["p"].op_name == ""


def test_bad_text_is_refused():
    with pytest.raises(hlo.HloParseError):
        hlo.collectives("not hlo at all")
    with pytest.raises(hlo.HloParseError):
        hlo.parse_replica_groups("<<nonsense>>")


# ---- positive controls: real compiled programs ---------------------------------------------------


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


@pytest.mark.timeout(300)
def test_psum_inside_a_scan_is_found_in_the_loop_on_its_axis():
    mesh = _mesh((2, 4), ("data", "tensor"))

    def body(x):
        def step(carry, _):
            return jax.lax.psum(carry, "tensor") * 0.5 + carry, None

        with jax.named_scope("mixer"):
            return jax.lax.scan(step, x, None, length=6)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor")))
    text = f.lower(jax.ShapeDtypeStruct((4, 32), jnp.float32)).compile().as_text()
    reductions = [c for c in hlo.collectives(text) if c.kind == hlo.ALL_REDUCE]
    assert reductions, "expected the psum as an all-reduce"
    (c,) = reductions
    assert c.loop_depth == 1 and c.trip_counts == (6,) and c.executions == 6 and not c.in_branch
    assert hlo.mesh_axes_of(c, mesh) == ("tensor",)
    assert c.size_bytes() == 2 * 8 * 4  # one device's [4/2, 32/4] block, fp32
    assert "/mixer/" in c.op_name  # the traced scope path, from the instruction's metadata


@pytest.mark.timeout(300)
def test_ppermute_and_branch_collectives_on_their_axes():
    mesh = _mesh((2, 2, 2), ("data", "pipeline", "tensor"))

    def body(x, i):
        y = jax.lax.ppermute(x, "pipeline", [(0, 1), (1, 0)])
        z = jax.lax.cond(i[0] > 0, lambda v: jax.lax.psum(v, "data") + v, lambda v: v * 2.0, y)
        return z

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data", "tensor"), P()), out_specs=P("data", ("pipeline", "tensor"))))
    args = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32))
    found = hlo.collectives(f.lower(*args).compile().as_text())
    permutes = [c for c in found if c.kind == hlo.COLLECTIVE_PERMUTE]
    reductions = [c for c in found if c.kind == hlo.ALL_REDUCE]
    assert len(permutes) == 1 and hlo.mesh_axes_of(permutes[0], mesh) == ("pipeline",)
    assert not permutes[0].in_branch and permutes[0].size_bytes() == 2 * 4 * 4
    assert len(reductions) == 1 and reductions[0].in_branch
    assert hlo.mesh_axes_of(reductions[0], mesh) == ("data",)


@pytest.mark.timeout(300)
def test_partitioner_made_collectives_map_to_mesh_axes():
    # A contraction over a dimension sharded on `tensor`: the partitioner all-reduces over
    # tensor only; a gather of the `data`-sharded rows is an all-gather over data only.
    mesh = _mesh((2, 4), ("data", "tensor"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "tensor")))
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None)))

    def f(x, w):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P()))

    found = hlo.collectives(jax.jit(f).lower(x, w).compile().as_text())
    summary = sorted((c.kind, hlo.mesh_axes_of(c, mesh), c.size_bytes()) for c in found)
    # Partial sums [4, 4] all-reduced over tensor, then the data halves gathered to [8, 4].
    assert summary == [(hlo.ALL_GATHER, ("data",), 8 * 4 * 4), (hlo.ALL_REDUCE, ("tensor",), 8 * 4 * 4)] or summary == [
        (hlo.ALL_GATHER, ("data",), 8 * 4 * 4),
        (hlo.ALL_REDUCE, ("tensor",), 4 * 4 * 4),
    ]
