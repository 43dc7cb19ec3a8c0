"""Reading a compiled step's launches from XLA's thunk sequence (the H100 compiles in
tests/test_compile_ladder.py read real ones)."""

from jaxserve.runner.launches import counted_entry_loops, entry_arguments, thunk_launches

THUNKS = """000: kCommandBuffer [source       | next=236 (1)]
    001: kCustomKernel [source       | next=002 (1)] gemm_fusion_dot_general_1 grid: [32, 1, 1]
    002: kCopy         [prev=001 (1) | sink        ] kCopy
236: kConditional   [prev=000 (1) | next=300 (1)]
  false_branch:
    000: kCommandBuffer [source | sink]
        221: kCustomKernel [source       | next=224 (3)] loop_select_fusion_8 grid: [393, 1, 1]
  true_branch:
    240: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1]
    241: kWhile        [source       | sink        ]
    condition:
      242: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
300: kCustomKernel  [prev=236 (1) | sink        ] loop_pad_fusion_1 grid: [2, 1, 1]
"""

HLO = """HloModule jit_step, is_scheduled=true

%fused (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %neg = f32[4]{0} negate(%p0)
}

ENTRY %main.9 (a: f32[4], b: f32[4], c: s32[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = s32[] parameter(2)
  %t = (s32[], f32[4]) tuple(%c, %a)
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %u = (s32[], f32[4]) while(%w), condition=%cond2, body=%body2
  ROOT %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused
}
"""


def test_thunks_are_counted_as_host_ops_kernels_and_graphs():
    launches = thunk_launches(THUNKS, num_arguments=3)
    assert launches.host_ops == {"kCommandBuffer": 1, "kConditional": 1, "kCustomKernel": 1}
    assert launches.num_host_ops == 3 and launches.host_syncs == 1
    assert launches.num_graphs == 2, "a command buffer inside a branch counts too"
    assert launches.num_kernels == 6 and launches.kernels_in_graphs == 3
    assert launches.control_flow == {"kConditional": 1, "kWhile": 1}
    assert abs(launches.graph_share - 0.5) < 1e-9


def test_entry_arguments_are_the_entry_computation_s_parameters():
    assert entry_arguments(HLO) == 3


def test_a_loop_of_known_trip_count_reads_no_predicate():
    assert counted_entry_loops(HLO) == 1, "the loop without known_trip_count is not counted"
    thunks = "000: kCommandBuffer [source]\n001: kWhile [prev=000]\n  body:\n    000: kCommandBuffer [source]\n"
    assert thunk_launches(thunks, num_arguments=3).host_syncs == 1
    counted = thunk_launches(thunks, num_arguments=3, counted_loops=1)
    assert counted.host_syncs == 0 and counted.num_host_ops == 2 and counted.num_graphs == 2
    # A conditional at the top of the loop's body reads its predicate every iteration.
    with_branch = thunks + "    001: kConditional [prev=000]\n      true_branch:\n        002: kKernel [source]\n"
    assert thunk_launches(with_branch, num_arguments=3, counted_loops=1).host_syncs == 1
