"""The layout planner and the simulation sweep: the scale planner and its virtual clock, the step model's fit on
step traces and its validation against measured runs, and simulated systems run through the real harness."""
