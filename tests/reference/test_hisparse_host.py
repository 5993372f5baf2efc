"""hisparse_host reference: S7 as a fixed vector, the hole precondition, typed errors, the pre-#23606 variant."""

import pytest

from kvproof.reference import hisparse_host as hh
from kvproof.reference.errors import ConfigError, InvalidOperation, InvariantViolation, OutOfMemory

S7 = hh.HostPoolConfig(page_size=64, num_pages=40, max_req_slots=4, max_context_len=2048)


def staged(config: hh.HostPoolConfig = S7, n: int = 1000, req: int = 0) -> hh.HostPoolState:
    state, slots = hh.admit_request_into_staging(hh.initial_state(config), req, list(range(n)))
    assert len(slots) == n
    return state


def test_s7_vector() -> None:
    """§9 S7: 1 000 tokens -> 16 pages; positions 1 000..1 023 allocate nothing; 1 024 one page; finish frees 17."""
    state = staged()
    assert len(state.rows[0]) == 1024 and hh.available_size(state) == (40 - 16) * 64
    seen = []
    for seq_len in range(1001, 1027):  # the backup writes position seq_len - 2, the first one is skipped
        state, written = hh.eager_backup_previous_token(state, [0], [seq_len], [10_000 + seq_len])
        seen.append((seq_len, len(state.rows[0]), written))
        hh.check_host_pool(state)
    assert seen[0] == (1001, 1024, ())  # skipped right after admission
    assert seen[-2] == (1025, 1024, (1023,))  # position 1 023: no allocation
    assert seen[-1] == (1026, 1088, (1024,))  # position 1 024: one new page
    before = hh.available_size(state)
    state = hh.request_finished(state, 0)
    assert (hh.available_size(state) - before) // 64 == 17
    assert state.rows[0] == () and not state.skip_first_backup[0]
    hh.check_host_pool(state)
    assert hh.snapshot(state).free_slots[-17 * 64:] == tuple(range(1088))  # freed as whole aligned pages, in order


def test_s7_hole_is_rejected_and_changes_nothing() -> None:
    """S7's assertion case: start_pos 2 000 with allocated length 1 088 (holes are forbidden)."""
    state = staged(n=1025)
    assert len(state.rows[0]) == 1088
    with pytest.raises(InvalidOperation) as err:
        hh.alloc_paged_token_slots(state, 0, 2000, 1)
    assert err.value.argument == "start_pos" and "2000 > allocated length 1088" in str(err.value)


def test_overlapping_ranges_reuse_slots() -> None:
    state = staged(n=5)
    state2, again = hh.alloc_paged_token_slots(state, 0, 2, 3)
    assert state2 == state and again == state.rows[0][2:5]


def test_out_of_host_memory_names_request_and_pages() -> None:
    config = hh.HostPoolConfig(page_size=4, num_pages=3, max_req_slots=2, max_context_len=20)
    state = staged(config, n=9)  # 3 pages: the pool is full
    with pytest.raises(OutOfMemory) as err:
        hh.admit_request_into_staging(state, 1, [1, 2])
    assert (err.value.request, err.value.pages_needed, err.value.pages_free) == (1, 1, 0)
    assert "for request 1" in str(err.value)


def test_backup_batch_is_all_or_nothing() -> None:
    config = hh.HostPoolConfig(page_size=2, num_pages=5, max_req_slots=3, max_context_len=20)
    state = hh.initial_state(config)
    state, _ = hh.admit_request_into_staging(state, 0, [1, 2])
    state, _ = hh.admit_request_into_staging(state, 1, [3, 4])
    state, _ = hh.admit_request_into_staging(state, 2, [5, 6, 7, 8])  # 4 of 5 pages taken
    state, _ = hh.eager_backup_previous_token(state, [0, 1, 2], [3, 3, 5], [0, 0, 0])  # first backups skipped
    with pytest.raises(OutOfMemory) as err:  # slots 0 and 1 both open a page at position 2; one page free
        hh.eager_backup_previous_token(state, [0, 1], [4, 4], [9, 9])
    assert err.value.pages_needed == 2 and err.value.request == 0


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda s: hh.alloc_paged_token_slots(s, 5, 0, 1), "req"),
        (lambda s: hh.alloc_paged_token_slots(s, 0, -1, 1), "start_pos"),
        (lambda s: hh.alloc_paged_token_slots(s, 0, 1025, 1), "start_pos"),
        (lambda s: hh.alloc_paged_token_slots(s, 0, 0, 2048 + 64 + 1), "num_tokens"),  # rounds past the row
        (lambda s: hh.admit_request_into_staging(s, 0, [1]), "req"),
        (lambda s: hh.admit_request_into_staging(s, 1, []), "values"),
        (lambda s: hh.eager_backup_previous_token(s, [1], [3], [7]), "seq_lens"),
        (lambda s: hh.eager_backup_previous_token(s, [0, 0], [3, 3], [7, 7]), "reqs"),
        (lambda s: hh.alloc(s, 3), "need_size"),
        (lambda s: hh.set_host_data(s, [5000 - 1], [1]), "slots"),
    ],
)
def test_misuse_is_typed(call, argument: str) -> None:
    """Each precondition raises InvalidOperation naming its argument (the runtime's tests check state is kept)."""
    with pytest.raises(InvalidOperation) as err:
        call(staged())
    assert err.value.argument == argument


def test_row_width_precondition_is_exact() -> None:
    """Rows are max_context_len + P wide: any end <= max_context_len fits; the first end past floor_P(width) not."""
    config = hh.HostPoolConfig(page_size=64, num_pages=40, max_req_slots=1, max_context_len=100)
    assert config.row_width == 164
    state, _ = hh.alloc_paged_token_slots(hh.initial_state(config), 0, 0, 128)  # 128 = floor_P(164)
    assert len(state.rows[0]) == 128
    with pytest.raises(InvalidOperation):
        hh.alloc_paged_token_slots(state, 0, 128, 1)  # rounds to 192 > 164


def test_pre_23606_staging_breaks_the_page_rule() -> None:
    """§4.7: with the host page size set to the device's 64, the old alloc(prefill_len) of 1 000 tokens fails."""
    config = S7.model_copy(update={"coordinator": hh.Coordinator.PRE_23606})
    with pytest.raises(InvalidOperation, match="1000 is not a multiple of page_size 64"):
        staged(config)


def test_pre_23606_host_pages_of_one_break_transfer_pages() -> None:
    """Before #23606 (P_h = 1 under device pages of 64) the second request's row is not made of 64-slot pages."""
    config = hh.HostPoolConfig(page_size=1, num_pages=4096, max_req_slots=2, max_context_len=2048,
                               device_page_size=64, coordinator=hh.Coordinator.PRE_23606)
    state = staged(config)
    hh.check_host_pool(state)  # the first row starts at slot 0: aligned by luck
    state, _ = hh.admit_request_into_staging(state, 1, list(range(1000)))
    with pytest.raises(InvariantViolation, match=r"\[H1\] request slot 1: positions \[0, 64\)"):
        hh.check_host_pool(state)


def test_paged_coordinator_needs_host_page_equal_device_page() -> None:
    with pytest.raises(ConfigError, match=r"^HostPoolConfig\.device_page_size: coordinator 'paged' uses") as e:
        hh.HostPoolConfig(page_size=1, num_pages=8, max_req_slots=1, max_context_len=8, device_page_size=64)
    assert (e.value.model, e.value.field) == ("HostPoolConfig", "device_page_size")


def test_requested_size_rounds_up_plus_one_page() -> None:
    """§4.2: page_num = size // P_h + 1."""
    assert hh.HostPoolConfig.from_requested_size(1000, 64, max_req_slots=1, max_context_len=8).num_pages == 16
    with pytest.raises(ConfigError, match=r"^HostPoolConfig\.max_req_slots: "):
        hh.HostPoolConfig.from_requested_size(1000, 64, max_req_slots=0, max_context_len=8)


def test_invariant_checker_catches_broken_snapshots() -> None:
    """The checker itself: each of H0, H1, H2 is reported on a hand-broken snapshot."""
    good = hh.snapshot(staged(n=65))
    hh.check_host_snapshot(good)
    cases = {
        "H0": good.model_copy(update={"free_slots": good.free_slots[1:] + good.free_slots[:1]}),
        "H1": good.model_copy(update={"allocated_len": (65, *good.allocated_len[1:])}),
        "H2": good.model_copy(update={"free_slots": good.free_slots[64:]}),
    }
    for invariant, snap in cases.items():
        with pytest.raises(InvariantViolation) as err:
            hh.check_host_snapshot(snap)
        assert err.value.invariant == invariant
