#!/usr/bin/env python3
"""The prototype memory model (memmodel.py) against the peaks measured on 2026-11-28 (results.txt:
model, image, grid, dtype, kernels, measured MiB, tessera plan's estimate, its inference estimate)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memmodel import model_peak, MIB
F = 64
rows = []
for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results.txt')):
    p = l.split()
    if len(p) < 8: continue
    m, img, g, dt, kn, meas, plan, inf = p[:8]
    C, H, W = map(int, img.split('x'))
    n, gh, gw = map(int, g.split('x'))
    d = 4 if dt == 'float32' else 8
    live, why = model_peak(m, C, H, W, (gh, gw), d, kn)
    est = live / MIB + F
    rows.append((m, img, g, dt + ('' if kn == 'onednn' else ' ref'), float(meas), float(plan), est, why))
print("%-16s %-12s %-6s %-12s %9s %9s %9s %6s %6s" % ("model","image","grid","dtype","measured","now","new","now/m","new/m"))
for m, img, g, dt, meas, plan, est, why in rows:
    print("%-16s %-12s %-6s %-12s %9.1f %9.1f %9.1f %6.2f %6.2f  %s" % (m, img, g, dt, meas, plan, est, plan/meas, est/meas, why))
