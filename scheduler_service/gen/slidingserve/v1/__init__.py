"""Generated from proto/ by tools/genproto.py. Do not edit."""
