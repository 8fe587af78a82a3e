"""``python -m tests.zoo``: run the coverage zoo and print where each architecture ran."""

from __future__ import annotations

from tests.zoo.architectures import ARCHITECTURES
from tests.zoo.coverage import run_case, summary

if __name__ == "__main__":
    print(summary([run_case(case) for case in ARCHITECTURES]))
