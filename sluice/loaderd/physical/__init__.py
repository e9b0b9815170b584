"""loaderd/physical"""
