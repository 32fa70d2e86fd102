"""The doctor: environment probe, audit rules over pitstop and Hugging Face configs, findings.

from pitstop.advise import doctor, format_findings
report = doctor(hf_args={"dataloader_num_workers": 0, "fp16": True}, compile_check=False)
print(format_findings(report["findings"]))
"""

from __future__ import annotations

from pitstop.advise.doctor import doctor
from pitstop.advise.environment import environment, format_environment
from pitstop.advise.finding import Finding, format_findings
from pitstop.advise.rules import RULES

__all__ = ["RULES", "Finding", "doctor", "environment", "format_environment", "format_findings"]
