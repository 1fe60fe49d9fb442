"""The instruments around the product: benches (bench/), kernel tuners (kernels/), the layout planner and the
simulation sweep (plan/), the peak finder (peak/) and the fault soak (soak/). No product package imports lab;
scripts/ holds their command lines."""
