"""`python -m experiments NAME ...` (or `report DIR`): the experiment commands where dspark is not pip-installed, so
its `dspark.commands` entry points are not registered."""
import sys

from experiments import main
from experiments.report import main as main_report

sys.exit(main_report(sys.argv[2:]) if sys.argv[1:2] == ["report"] else main(sys.argv[1:]))
