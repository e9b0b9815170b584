"""loaderd/logical"""
