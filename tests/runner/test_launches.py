"""Reading a compiled step's launches from its HLO: a hand-written module with every case, then a real
step compiled for the CPU (the H100 compile is in tests/test_compile_ladder.py)."""

from jaxserve.runner.launches import step_launches

HLO = """HloModule jit_step, is_scheduled=true

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %add = f32[4]{0} add(%p0, %p1)
}

%command_buffer (p: f32[4], q: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %q = f32[4]{0} parameter(1)
  %loop_add_fusion = f32[4]{0} fusion(%p, %q), kind=kLoop, calls=%fused_add
  %gemm = (f32[4]{0}, s8[16]{0}) custom-call(%p, %q), custom_call_target="__cublas$gemm"
  %gte = f32[4]{0} get-tuple-element(%gemm), index=0
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%loop_add_fusion, %gte)
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %triton = f32[4]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %next = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %r = (s32[], f32[4]{0}) tuple(%next, %triton)
}

%cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%s), kind=kLoop, calls=%fused_add
}

ENTRY %main.9 (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %call = (f32[4]{0}, f32[4]{0}) call(%a, %b), to_apply=%command_buffer
  %x = f32[4]{0} get-tuple-element(%call), index=0
  %init = (s32[], f32[4]{0}) tuple(%x, %x)
  %while.1 = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %y = f32[4]{0} get-tuple-element(%while.1), index=1
  ROOT %copy = f32[4]{0} copy(%y)
}
"""


def test_launches_are_counted_inside_and_outside_command_buffers():
    launches = step_launches(HLO)
    assert launches.num_arguments == 2
    assert launches.num_command_buffers == 1 and launches.in_command_buffers == 2
    assert launches.by_kind == {"fusion:kLoop": 3, "custom-call:__cublas$gemm": 1,
                                "custom-call:__gpu$xla.gpu.triton": 1, "copy": 1}
    assert launches.num_launches == 6
    assert launches.outside_command_buffers == {"fusion:kLoop": 2, "custom-call:__gpu$xla.gpu.triton": 1, "copy": 1}
    assert launches.control_flow == {"while": 1}
    assert abs(launches.command_buffer_share - 2 / 6) < 1e-9


def test_a_real_compiled_step_parses():
    import jax
    import jax.numpy as jnp

    compiled = jax.jit(lambda x, y: jnp.tanh(x @ y).sum(axis=0)).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile()
    launches = step_launches(compiled.as_text())
    assert launches.num_arguments == 2 and launches.num_launches >= 1
    assert launches.num_command_buffers == 0 and launches.in_command_buffers == 0  # none on a CPU
