#!/usr/bin/env python3
"""A synthetic interactive trace for `sluicegate eval --trace`, built by a
process that no scenario uses and no default was tuned on: a three-state
Markov-modulated Poisson arrival stream (calm, busy, spike) with a
two-class prompt mix and heavy-tailed outputs. Sized for the small pool
(4 replicas of the calibrated engine): about 34 requests/s on average,
spikes above what the pool serves within its SLO.

    python3 scripts/make-trace.py > /tmp/mmpp.csv
    ./target/release/sluicegate eval --trace /tmp/mmpp.csv --pool small

Deterministic: Python's Mersenne Twister with a fixed seed.
"""
import math
import random
import sys

SEED = 20261125
DURATION_S = 1200.0
# state: (requests/s, mean dwell s, next states)
STATES = {
    "calm": (20.0, 60.0, ["busy", "busy", "spike"]),
    "busy": (42.0, 40.0, ["calm", "calm", "spike"]),
    "spike": (95.0, 10.0, ["calm", "busy"]),
}


def lognormal(rng, mean, cv):
    sigma2 = math.log(1.0 + cv * cv)
    mu = math.log(mean) - sigma2 / 2.0
    return rng.lognormvariate(mu, math.sqrt(sigma2))


def main():
    rng = random.Random(SEED)
    out = sys.stdout
    out.write("timestamp,input_tokens,output_tokens\n")
    t, state = 0.0, "calm"
    leave = rng.expovariate(1.0 / STATES[state][1])
    while True:
        rate = STATES[state][0]
        t += rng.expovariate(rate)
        if t >= leave:
            # Memoryless arrivals: restart the clock in the next state.
            t = leave
            state = rng.choice(STATES[state][2])
            leave = t + rng.expovariate(1.0 / STATES[state][1])
            continue
        if t >= DURATION_S:
            break
        if rng.random() < 0.7:
            prompt = lognormal(rng, 400.0, 0.8)
        else:
            prompt = lognormal(rng, 1500.0, 0.5)
        output = lognormal(rng, 180.0, 1.0)
        prompt = max(1, min(6000, round(prompt)))
        output = max(1, min(1024, round(output)))
        out.write(f"{t:.4f},{prompt},{output}\n")


if __name__ == "__main__":
    main()
