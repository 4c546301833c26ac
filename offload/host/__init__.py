"""The host side: the exact-size host arena, the fp32 masters and AdamW state laid out in it, the CPU AdamW."""
