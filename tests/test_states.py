import pytest

from split_state import MIRRORED, PARTIAL, Split, SplitError, local_shape, pieces, validate
from split_state.states import decode_state, encode_state


def test_str_and_repr_are_compact_and_exact():
    s = Split(1, ((3, 2),))
    assert str(s) == "S1[3|2]"
    assert repr(s) == "Split(axis=1, segments=((3, 2),))"
    assert str(Split(0, ((2, 2), (1, 0)))) == "S0[2|2,1|0]"
    assert str(MIRRORED) == "M" and str(PARTIAL) == "P"
    assert eval(repr(s)) == s and hash(eval(repr(s))) == hash(s)


def test_even_spreads_remainder_by_granule():
    assert Split.even(0, 10, 3).segments == ((4, 3, 3),)
    assert Split.even(1, 12 * 32, 5, granularity=32).segments == ((96, 96, 64, 64, 64),)
    # more devices than granules: trailing devices get zero
    assert Split.even(0, 2, 4).segments == ((1, 1, 0, 0),)
    # fused QKV: three segments, each split by heads
    qkv = Split.even(1, (4, 4, 4), 2, granularity=2)
    assert qkv.segments == ((2, 2), (2, 2), (2, 2)) and qkv.size == 12


def test_even_rejects_sizes_not_multiple_of_granularity():
    with pytest.raises(SplitError, match="multiple of granularity 4"):
        Split.even(0, 10, 2, granularity=4)


@pytest.mark.parametrize(
    "state, shape, n, message",
    [
        (Split(2, ((1, 1),)), (2, 2), 2, "splits axis 2 but shape \\(2, 2\\) has only 2 axes"),
        (Split(0, ((1, 1),)), (3,), 2, "extents sum to 2 but shape \\(3,\\) has 3 along axis 0"),
        (Split(0, ((1, 1, 1),)), (3,), 2, "lists extents for 3 devices but the device count is 2"),
        (MIRRORED, (3,), 0, "need at least one device"),
    ],
)
def test_validate_names_shape_axis_extents_and_devices(state, shape, n, message):
    with pytest.raises(SplitError, match=message):
        validate(state, shape, n, name="w")


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, ((1,),)), "non-negative int"),
        ((0, ()), "at least one segment"),
        ((0, ((1, 2), (1,))), "one extent per device"),
        ((0, ((1, -1),)), ">= 0"),
        ((0, "ab"), "ints"),
    ],
)
def test_bad_constructions_raise_split_error(args, message):
    with pytest.raises(SplitError, match=message):
        Split(*args)


def test_pieces_of_segmented_split():
    qkv = Split(0, ((2, 1), (2, 1), (2, 1)))  # global: Q0 Q0 Q1 | K0 K0 K1 | V0 V0 V1
    p0 = pieces(qkv, (9, 4), 2, 0)
    assert [(p.global_start, p.global_stop, p.local_start) for p in p0] == [(0, 2, 0), (3, 5, 2), (6, 8, 4)]
    p1 = pieces(qkv, (9, 4), 2, 1)
    assert [(p.global_start, p.global_stop, p.local_start) for p in p1] == [(2, 3, 0), (5, 6, 1), (8, 9, 2)]
    assert local_shape(qkv, (9, 4), 2, 0) == (6, 4) and local_shape(qkv, (9, 4), 2, 1) == (3, 4)


def test_zero_extent_device_holds_nothing():
    s = Split(1, ((0, 3),))
    assert pieces(s, (2, 3), 2, 0) == ()
    assert local_shape(s, (2, 3), 2, 0) == (2, 0)


@pytest.mark.parametrize("state", [MIRRORED, PARTIAL, Split(1, ((1, 2), (0, 3)))])
def test_wire_encoding_round_trips(state):
    assert decode_state(encode_state(state)) == state


@pytest.mark.parametrize("bad", [None, [], ["X"], ["S", 0], ["S", 0, [[1.5]]], ["M", 1], "M", ["S", "a", [[1]]]])
def test_wire_decoding_rejects_malformed(bad):
    with pytest.raises(SplitError):
        decode_state(bad)
