"""loaderd"""
