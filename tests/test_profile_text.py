"""`pitstop profile -- CMD` prints its report without importing transformers: the text is
pitstop.advise.profile_text's, which PitstopCallback prints too (test_hf_callback checks
the two texts are equal)."""

from __future__ import annotations

import subprocess
import sys


def test_printing_a_profile_report_does_not_import_transformers() -> None:
    code = (
        "import sys\n"
        "from pitstop.anyloop.launch import format_results\n"
        "from pitstop.measure.schema import make_profile\n"
        "rec = {'data_wait': 0.05, 'forward': 0.02, 'backward': 0.03}\n"
        "p = make_profile([rec] * 4, [0.1] * 4, warmup=1, source='pitstop', trained_tokens=2048)\n"
        "text = format_results(p, {'findings': []})\n"
        "assert 'pitstop profile: 4 steps' in text, text\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
