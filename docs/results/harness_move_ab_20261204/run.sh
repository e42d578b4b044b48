#!/bin/bash
# Interleaved A/B: e81bfcb (A) vs HEAD (B), MoE and KDA benches, 3 rounds.
cd /tmp/ab
A=/tmp/e81/b/k3; B=/work/main/build-test/k3
for r in 1 2 3; do
  for v in A B; do
    bin=${!v}
    $bin bench moe --m 1,8,128 --recipe w4a8 --iters 7 --bandwidth-mib 256 --output moe_${v}_$r.json > moe_${v}_$r.log 2>&1
    extra=""; [ $v = B ] && extra="--verify-n 0"
    $bin bench kda --prefill-t 64 1024 --decode-n 1 16 $extra --iters 5 --bw-mib 256 --output kda_${v}_$r.json > kda_${v}_$r.log 2>&1
  done
done
echo done > /tmp/ab/DONE
