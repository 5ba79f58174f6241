"""Per round, how much longer each prediction of this folder's validations is than the measured run.

    python benchmarks/h100/simulator_validation_20261207/excess.py [FOLDER ...]

Tokens of a C are its plain row's (tokens/s x seconds, `constants[C]["plain_run"]`); each row's measured and
predicted seconds are those tokens over its tokens/s, and the excess is their difference over its measured
rounds. Written for RESULTS' thirteenth-session section (the 0.34-0.45 ms a DSpark verify-all round).
"""
import json
import sys
from pathlib import Path

here = Path(__file__).parent
for folder in sys.argv[1:] or sorted(p for p in here.iterdir() if (p / "simulator_validation.json").is_file()):
    doc = json.loads((Path(folder) / "simulator_validation.json").read_text())
    print(f"== {Path(folder).name}")
    for r in doc["rows"]:
        if r["fitted"]:
            continue
        C = r["concurrency"]
        plain = next(x for x in doc["rows"] if x["concurrency"] == C and x["fitted"])
        tokens = plain["measured_tokens_per_s"] * doc["constants"][str(C)]["plain_run"]["seconds"]
        measured, predicted = tokens / r["measured_tokens_per_s"], tokens / r["predicted_tokens_per_s"]
        per_round = 1000 * measured / r["rounds"]
        print(f"{r['method']:7} {r['policy']:9} C={C:3}  rounds {r['rounds']:5}  measured {per_round:.3f} ms/round"
              f"  excess {1000 * (predicted - measured) / r['rounds']:+.3f} ms/round")
