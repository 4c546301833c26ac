"""Planning: pure functions of data (a trace, the hardware model, a budget) that return frozen plans.

Nothing here holds device state or touches streams: the runtime executes what these return.
"""
