"""Print the fastest ONE_ACC forward config of a tune CSV (median of its passes) as BMxBNxBK:wW:sS[:KEY=INT...]."""
import sys

import pandas as pd

d = pd.read_csv(sys.argv[1])
d = d[(d.status == "ok") & (d.config == "forced") & d.extra_meta.fillna("").str.contains("ONE_ACC")]
for col in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"):
    d[col] = d[col].astype(int)
d["name"] = (d.BLOCK_M.astype(str) + "x" + d.BLOCK_N.astype(str) + "x" + d.BLOCK_K.astype(str) + ":w" + d.num_warps.astype(str)
             + ":s" + d.num_stages.astype(str) + ":" + d.extra_meta.str.replace(" ", ":"))
best = d.groupby("name").median_ms.median().sort_values()
print(best.index[0])
