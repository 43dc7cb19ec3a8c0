"""PTX cut out of a kernel compile's output and assembled by the real ptxas (the gpu-compile extra's, here),
as `benchmarks/mosaic_registers.py` does on a GPU with Mosaic GPU's printed PTX."""

import pytest

from jaxserve.bench.ptxas import PTX_HEADER, find_ptxas, ptx_modules, ptxas_figures

# Two kernels: one that keeps everything in registers, one with a 64-byte local array indexed at run time
# (a stack frame, as a spilling kernel has).
PTX = PTX_HEADER + """
//

.version 8.0
.target sm_90a
.address_size 64

.visible .entry add_one(
	.param .u64 add_one_param_0
)
{
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<3>;
	ld.param.u64 	%rd1, [add_one_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	ld.global.u32 	%r1, [%rd2];
	add.s32 	%r2, %r1, 1;
	st.global.u32 	[%rd2], %r2;
	ret;
}

.visible .entry on_the_stack(
	.param .u64 on_the_stack_param_0
)
{
	.local .align 4 .b8 	scratch[64];
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<6>;
	ld.param.u64 	%rd1, [on_the_stack_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	ld.global.u32 	%r1, [%rd2];
	and.b32 	%r2, %r1, 15;
	mov.u64 	%rd3, scratch;
	mul.wide.u32 	%rd4, %r2, 4;
	add.s64 	%rd5, %rd3, %rd4;
	st.local.u32 	[%rd5], %r1;
	ld.local.u32 	%r3, [scratch];
	st.global.u32 	[%rd2], %r3;
	ret;
}
"""


def test_modules_are_cut_from_the_lines_around_them():
    """The PTX between other output (a marker before, a log line after), and two modules in a row."""
    output = f"@@ configuration a\n{PTX}I0000 a log line after the module\n{PTX}"
    modules = ptx_modules(output)
    assert len(modules) == 2
    assert all(m.startswith(PTX_HEADER) and m.rstrip().endswith("}") for m in modules)
    assert "log line" not in modules[0] and ".entry on_the_stack" in modules[0]


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas here (the gpu-compile extra or a CUDA toolkit has one)")
def test_ptxas_reports_each_kernels_registers_and_stack():
    """The real assembler's `-v` report, read a kernel at a time."""
    figures = {f.kernel: f for f in ptxas_figures(ptx_modules(PTX)[0])}
    assert set(figures) == {"add_one", "on_the_stack"}
    assert 0 < figures["add_one"].registers <= 32
    assert figures["add_one"].stack_bytes == 0 and figures["add_one"].spill_store_bytes == 0
    assert figures["on_the_stack"].stack_bytes >= 64


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas here (the gpu-compile extra or a CUDA toolkit has one)")
def test_ptx_that_does_not_assemble_says_why():
    with pytest.raises(RuntimeError, match="ptxas failed"):
        ptxas_figures(PTX.replace("add.s32", "add.bogus"))


@pytest.mark.skipif(find_ptxas() is None, reason="no ptxas here (the gpu-compile extra or a CUDA toolkit has one)")
def test_a_newer_ptx_version_than_ptxas_reads_is_assembled_as_its_newest_and_said_so():
    """jaxlib's compiler library writes a newer PTX ISA than a toolkit's ptxas may read (9.5 from jaxlib 0.12
    against CUDA 13.0's 9.0): the module is assembled as the newest version ptxas reads, the same figures as
    a module written at that version, and each record names the version used."""
    as_written = {f.kernel: f for f in ptxas_figures(PTX)}
    newer = {f.kernel: f for f in ptxas_figures(PTX.replace(".version 8.0", ".version 99.9"))}
    assert set(newer) == set(as_written) and all(f.ptx_version for f in newer.values())
    assert all(f.ptx_version is None for f in as_written.values())
    assert newer["on_the_stack"].stack_bytes == as_written["on_the_stack"].stack_bytes >= 64
