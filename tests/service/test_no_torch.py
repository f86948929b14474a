"""The service never imports torch (a test-only dependency), even where torch is installed: loading a
Hugging Face checkpoint directory and generating through vSurge leave it out of sys.modules."""

import subprocess
import sys
import textwrap


def test_hf_directory_load_and_generate_do_not_import_torch(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        import vsurge
        from vsurge.contracts.sampling_params import SamplingParams
        from vsurge import vSurge
        model, tok = vsurge.load_model({path!r})
        s = vSurge.create_vdriver(model, tok, max_concurrent_decodes=1, prefill_lengths=[16], max_length=32)
        s.compile(); s.start()
        out = asyncio.run(s.generate(["hello"], SamplingParams(temperature=0, max_tokens=2)))
        s.stop()
        assert out[0].num_generated_tokens == 2
        print("torch loaded:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch loaded: []" in r.stdout, r.stdout
